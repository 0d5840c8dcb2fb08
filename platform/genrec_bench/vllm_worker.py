"""vLLM side of `genrec bench ... --peer vllm`, run by the peers venv's Python (`make peers`); imports no genrec.

Protocol, one JSON object per line: the first line on stdin is the engine spec ({"model", "dtype", "engine": {LLM
keyword arguments}}); the worker answers {"ready": true, ...}. Each further line is a job ({"task": ...}) and
gets one answer line; end of input ends the worker. Errors answer {"error": "..."}. Timed jobs clear vLLM's
prefix cache first (untimed), so every round starts from a fresh prompt as genrec's does.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    # The protocol keeps the real stdout; everything else written to fd 1 (vLLM's logs, its engine subprocess's
    # included) goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    spec = json.loads(sys.stdin.readline())
    start = time.perf_counter()
    llm = _load(spec)
    import vllm

    _answer(out, {"ready": True, "vllm": vllm.__version__, "load_s": time.perf_counter() - start})
    for line in sys.stdin:
        job = json.loads(line)
        try:
            _answer(out, TASKS[job["task"]](llm, job))
        except Exception as err:  # noqa: BLE001 - reported to the genrec side, which raises it
            _answer(out, {"error": f"{type(err).__name__}: {err}"})


def _answer(out, body: dict) -> None:
    out.write(json.dumps(body) + "\n")
    out.flush()


def _load(spec: dict):
    from vllm import LLM

    return LLM(model=spec["model"], tokenizer=spec["model"], dtype=spec["dtype"], **spec["engine"])


def _timed(llm, fn):
    llm.reset_prefix_cache()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def beam_search(llm, job: dict) -> dict:
    """LLM.beam_search over token prompts, fixed length (`max_tokens`, EOS ignored); generated tokens per beam."""
    from vllm import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    params = BeamSearchParams(beam_width=job["beam_width"], max_tokens=job["max_tokens"], ignore_eos=True)
    seconds, outputs = _timed(llm, lambda: llm.beam_search(prompts, params))
    beams = [
        [seq.tokens[len(prompt) :] for seq in out.sequences]
        for prompt, out in zip(job["prompts"], outputs, strict=True)
    ]
    return {"seconds": seconds, "beams": beams}


def score(llm, job: dict) -> dict:
    """One prompt per candidate, as vLLM users score: the label's log-probability after prompt + candidate.

    mode "prompt_logprobs": the label is the prompt's last token, read from prompt_logprobs (vLLM skips its prefix
    cache for such requests unless told otherwise: told here). mode "label_logprobs": one generated token with
    logprob_token_ids=[label].
    """
    from vllm import SamplingParams, TokensPrompt

    prefix, label = job["prompt"], job["label"]
    if job["mode"] == "prompt_logprobs":
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, skip_reading_prefix_cache=False, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=prefix + c + [label]) for c in job["candidates"]]
    else:
        params = SamplingParams(max_tokens=1, logprob_token_ids=[label], detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=prefix + c) for c in job["candidates"]]
    seconds, outputs = _timed(llm, lambda: llm.generate(prompts, params, use_tqdm=False))
    if job["mode"] == "prompt_logprobs":
        logprobs = [out.prompt_logprobs[-1][label].logprob for out in outputs]
    else:
        logprobs = [out.outputs[0].logprobs[0][label].logprob for out in outputs]
    cached = sum(out.num_cached_tokens or 0 for out in outputs)
    return {"seconds": seconds, "logprobs": logprobs, "cached_tokens": cached}


def next_token(llm, job: dict) -> dict:
    """The `top` most likely next tokens and their log-probabilities after each prompt (one greedy step)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=job["top"], detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
    tops = [{str(t): lp.logprob for t, lp in out.outputs[0].logprobs[0].items()} for out in outputs]
    return {"logprobs": tops, "greedy": [out.outputs[0].token_ids[0] for out in outputs]}


TASKS = {"beam_search": beam_search, "score": score, "next_token": next_token}

if __name__ == "__main__":
    main()
