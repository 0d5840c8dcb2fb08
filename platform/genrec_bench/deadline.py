"""`bench deadline`: does a deadline hold when a request's rows are long? (issue #29 item 6)

Two parts, one engine:
- **The cost model's fit.** Scoring passes of several shapes (many short rows over a short and a long context, rows
  of a few hundred tokens, the longest row one pass holds), each as many rows as the pass budget
  (`score_max_tokens` token-equivalents) takes: their seconds per token-equivalent should be one number, and the
  slowest is what "one bounded pass" takes on this machine.
- **The issue's case.** A score request of `--candidates` long candidates (`--candidate-len` tokens each; default
  the engine's `max_candidate_len`) with a `--deadline-s` deadline, and a small retrieve sent just behind it, on the
  in-process AsyncEngine: when the score's caller is released (its overshoot past the deadline, against one pass)
  and how long the retrieve took (against the retrieve alone). Also the issue's text candidates (`--words` words
  each): refused at once when over the cap.
"""

from __future__ import annotations

import random
import statistics
import threading
import time

import torch

from genrec.api import Candidate, RetrieveRequest, ScoreRequest
from genrec.engine import Engine
from genrec.engine.scoring import CandidateRows
from genrec.errors import GenrecError
from genrec_bench.cli import DeadlineOptions
from genrec_bench.common import decoder, described, machine, model_dir_for, random_prompt, timed
from genrec_bench.load import serving

PROMPT = 64  # tokens of the score request's prompt
WORDS = ("the", "story", "of", "a", "podcast", "about", "jazz", "history", "and", "its", "players", "on", "tour")


def run(o: DeadlineOptions) -> dict:
    if o.threads:
        torch.set_num_threads(o.threads)
    model_dir = model_dir_for(o.preset, o.model, None)
    limits = {"score_max_tokens": o.score_max_tokens, "max_candidate_len": o.max_candidate_len}
    engine = Engine.from_pretrained(model_dir, device=o.device, **limits)
    family = decoder(engine)
    length = o.candidate_len or family.max_candidate_len
    report = described(
        model_dir, o, "device", "candidates", "candidate_len", "words", "deadline_s", "repeats", "threads"
    )
    report["engine"] = {
        "score_max_tokens": family.score_max_tokens,
        "max_candidate_len": family.max_candidate_len,
        "context_span": family.cost.context_span,
        "own_span": family.cost.own_span,
    }
    report["passes"] = pass_fit(engine, o.repeats)
    report["text_candidates"] = text_request(engine, o.candidates, o.words)
    report["issue_case"] = issue_case(engine, o, length)
    report["machine"] = machine()
    return report


def pass_fit(engine: Engine, repeats: int) -> dict:
    """Seconds per token-equivalent of full passes of several shapes (median of `repeats` each)."""
    family, generator = decoder(engine), torch.Generator().manual_seed(0)
    cost, budget, longest = family.cost, family.score_max_tokens, family.max_candidate_len
    shapes = {"short_rows_short_context": (4, 64), "short_rows_long_context": (4, 2048)}
    shapes.update({"mid_rows": (min(256, longest), 64), "longest_row": (longest, 64)})
    rows = []
    for name, (length, context) in shapes.items():
        context = min(context, family.max_prompt_tokens - length)
        ctx = engine.runner.prefill_alone(engine.prepare(prompt_request(engine, context, generator))).ctx
        count = 1
        while cost.rows(count + 1, length, (count + 1) * context) <= budget and count < family.max_candidates:
            count += 1
        job = CandidateRows(ctx, [random_prompt(engine, length, generator) for _ in range(count)], (1, 2))
        warm = family.scorer.score_pass([job], budget)
        if sum(len(scores) for _, scores in warm) != count:
            raise RuntimeError(f"{name}: {count} rows are not one pass")  # the shapes are built to be one
        seconds = statistics.median(
            timed(lambda job=job: family.scorer.score_pass([job], budget), engine.device) for _ in range(repeats)
        )
        estimate = cost.rows(count, length, count * context)
        rows.append(
            {
                "shape": name,
                "rows": count,
                "tokens": length,
                "context": context,
                "token_equivalents": round(estimate),
                "padded_tokens": count * length,
                "seconds": seconds,
                "us_per_token_equivalent": 1e6 * seconds / estimate,
            }
        )
    per = [r["us_per_token_equivalent"] for r in rows]
    return {"shapes": rows, "slowest_pass_s": max(r["seconds"] for r in rows), "spread": max(per) / min(per)}


def prompt_request(engine, length: int, generator) -> RetrieveRequest:
    return RetrieveRequest(prompt_token_ids=random_prompt(engine, length, generator), beam_width=1)


def text_request(engine: Engine, count: int, words: int) -> dict:
    """The issue's request: `count` text candidates of `words` words each; refused (and how fast) or accepted."""
    rnd = random.Random(0)
    texts = [" ".join(rnd.choice(WORDS) for _ in range(words)) for _ in range(count)]
    request = ScoreRequest(prompt="a listener of jazz podcasts", candidates=[Candidate(text=t) for t in texts])
    start = time.perf_counter()
    try:
        prepared = engine.prepare(request)
    except GenrecError as err:
        return {"refused": True, "seconds": time.perf_counter() - start, "error": str(err)}
    lengths = [len(c) for c in prepared.candidate_tokens]
    return {"refused": False, "seconds": time.perf_counter() - start, "longest_candidate_tokens": max(lengths)}


def issue_case(engine: Engine, o: DeadlineOptions, length: int) -> dict:
    """Per repeat: the long score request with its deadline, a small retrieve 0.1 s behind it."""
    generator = torch.Generator().manual_seed(1)
    small = RetrieveRequest(prompt_token_ids=random_prompt(engine, 16, generator), beam_width=4)
    runs = []
    with serving(engine) as (async_engine, _):
        async_engine.submit(small).result()  # warm-up
        alone = statistics.median(timed_future(lambda: async_engine.submit(small))[1] for _ in range(3))
        for _ in range(o.repeats):
            cands = [Candidate(token_ids=random_prompt(engine, length, generator)) for _ in range(o.candidates)]
            request = ScoreRequest(prompt_token_ids=random_prompt(engine, PROMPT, generator), candidates=cands)
            score, score_s = start_timed(lambda r=request: async_engine.submit(r, o.deadline_s))
            time.sleep(0.1)
            retrieve, retrieve_s = start_timed(lambda: async_engine.submit(small))
            released, took = score_s(), retrieve_s()
            error = score.exception()
            status = "ok" if error is None else type(error).__name__
            runs.append(
                {
                    "score_status": status,
                    "released_s": released,
                    "overshoot_s": released - o.deadline_s,
                    "retrieve_s": took,
                }
            )
    overshoots = sorted(r["overshoot_s"] for r in runs)
    return {
        "candidate_tokens": length,
        "retrieve_alone_s": alone,
        "runs": runs,
        "overshoot_max_s": overshoots[-1],
        "overshoot_median_s": statistics.median(overshoots),
        "retrieve_median_s": statistics.median(r["retrieve_s"] for r in runs),
    }


def start_timed(submit):
    """(future, wait) where wait() blocks until the future is done and gives the seconds from submit to done (read
    in its done callback, not when this thread wakes)."""
    done, stamp = threading.Event(), {}
    start = time.perf_counter()
    future = submit()

    def finished(_):
        stamp["at"] = time.perf_counter()
        done.set()

    future.add_done_callback(finished)

    def wait() -> float:
        done.wait()
        return stamp["at"] - start

    return future, wait


def timed_future(submit):
    future, wait = start_timed(submit)
    return future, wait()
