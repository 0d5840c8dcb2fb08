"""`--peer vllm`: the same model directory and prompts through vLLM, timed round-robin with genrec in one run.

vLLM lives in its own venv (`make peers`) and runs in a subprocess (`vllm_worker.py`, JSON lines in and out).
Its times are measured inside the worker, around the vLLM call alone; genrec's around the Engine call.
On a CPU vLLM gets the tuning it needs to be fair: its OpenMP threads bound to as many cores as genrec has
threads (all of them by default), a KV cache sized for the job, block size 32, eager mode, float32. Before each
timed call its prefix cache is cleared: every round starts from a new prompt, as genrec's does.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from genrec.engine.request_tokens import candidate_token_lists, label_token_ids
from genrec.errors import GenrecError
from genrec_bench.common import decoder, timed

PEERS = ("vllm",)
WORKER = Path(__file__).with_name("vllm_worker.py")
# vLLM 0.32's CPU attention (CPUAttentionBackend.get_supported_head_sizes).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
BLOCK_SIZE = 32


class PeerError(GenrecError):
    """The peer cannot run this comparison (not installed, unsupported shape, or it failed)."""


def peers_venv() -> Path:
    """GENREC_PEERS_VENV, else the repository's `.venv-peers` (what `make peers` creates)."""
    default = Path(__file__).resolve().parents[2] / ".venv-peers"
    return Path(os.environ.get("GENREC_PEERS_VENV", default))


def check(peer: str, config, device: str, beam_width: int = 0) -> None:
    """Refuse, before any work, what the peer cannot run."""
    if peer not in PEERS:
        raise PeerError(f"--peer: unknown peer {peer!r}; choose one of {list(PEERS)}")
    if beam_width and config.vocab_size < 2 * beam_width:
        raise PeerError(
            f"--peer vllm: vLLM's beam search takes the top 2 x beam width ({2 * beam_width}) tokens per step and "
            f"crashes on this model's vocabulary of {config.vocab_size}: use beam width <= {config.vocab_size // 2} "
            "or a model with a larger vocabulary"
        )
    if not str(device).startswith("cuda") and config.head_dim not in CPU_HEAD_SIZES:
        raise PeerError(
            f"--peer vllm: vLLM's CPU attention does not support head size {config.head_dim} "
            f"(supported: {list(CPU_HEAD_SIZES)}); write the model with e.g. `genrec tiny-model --head-dim 64`"
        )
    python = peers_venv() / "bin" / "python"
    if not python.exists():
        raise PeerError(f"--peer vllm: no peers venv at {python.parent.parent}: run `make peers` first")


class VllmPeer:
    """One vLLM worker process on a model directory; `call(job)` sends a job and returns its answer."""

    def __init__(self, model_dir: Path, config, device: str, dtype: str, max_model_len: int, rows: int, logprobs=20):
        cpu = not str(device).startswith("cuda")
        engine = {
            "max_model_len": max_model_len,
            "max_logprobs": max(20, logprobs),
            "max_num_seqs": max(256, rows),
            "enable_prefix_caching": True,
            "seed": 0,
        }
        env = dict(os.environ)
        if cpu:
            engine.update(enforce_eager=True, block_size=BLOCK_SIZE)
            cores = sorted(os.sched_getaffinity(0))[: torch.get_num_threads()]  # as many as genrec's threads
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(_kv_cache_gib(config, max_model_len, rows)))
        else:
            engine["gpu_memory_utilization"] = 0.5  # genrec's engine holds the rest of the device
        self.options = {**engine, **{k: v for k, v in env.items() if k.startswith("VLLM_")}}
        self.log = tempfile.TemporaryFile(mode="w+")
        python = peers_venv() / "bin" / "python"
        self.proc = subprocess.Popen(  # -I: the worker's folder (genrec_bench) must not shadow vLLM's imports
            [str(python), "-I", str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            text=True, env=env,
        )  # fmt: skip
        try:
            self.ready = self.call({"model": str(model_dir), "dtype": dtype, "engine": engine})
        except BaseException:
            self.close()
            raise

    def call(self, job: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the worker is gone: its log says why
        line = self.proc.stdout.readline()
        if not line:
            raise PeerError(f"vLLM worker exited (code {self.proc.wait()}):\n{self._log_tail()}")
        answer = json.loads(line)
        if "error" in answer:
            raise PeerError(f"vLLM failed on {job.get('task', 'load')}: {answer['error']}")
        return answer

    def _log_tail(self, lines: int = 25) -> str:
        self.log.seek(0)
        return "\n".join(self.log.read().splitlines()[-lines:])

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()  # end of input ends the worker
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def compare_retrieve(engine, model_dir: Path, requests, device: str, repeats: int) -> dict:
    """vLLM's LLM.beam_search (unconstrained) vs Engine.retrieve on the same prompts, round-robin."""
    levels, width = engine.catalog.levels, requests[0].beam_width
    prompts = [r.prompt_token_ids for r in requests]
    job = {"task": "beam_search", "prompts": prompts, "beam_width": width, "max_tokens": levels}
    longest = max(map(len, prompts)) + levels
    with _peer(engine, model_dir, device, longest, width * len(requests), logprobs=2 * width) as peer:
        seconds, rounds, answer = _round_robin(
            lambda: engine.retrieve(requests), {"vllm_beam_search": job}, peer, device, repeats
        )
    ours = engine.retrieve(requests)
    valid = set(map(tuple, engine.catalog.codes.tolist()))
    beams = [tuple(b) for per_prompt in answer["vllm_beam_search"]["beams"] for b in per_prompt]
    same_top = [
        bool(mine.items) and tuple(mine.items[0].semantic_id) == tuple(theirs[0])
        for mine, theirs in zip(ours, answer["vllm_beam_search"]["beams"], strict=True)
    ]
    return {
        **peer.ready,
        "options": peer.options,
        "seconds": seconds,
        "rounds": rounds,
        "ratios": _ratios(seconds, rounds, "vllm_beam_search"),
        "beams": len(beams),
        "beams_not_in_catalog": sum(b not in valid for b in beams),
        "top_beam_agreement": sum(same_top) / len(same_top),
    }


def compare_score(engine, model_dir: Path, request, device: str, repeats: int) -> dict:
    """vLLM's per-candidate scoring (one prompt per candidate, prefix caching on) vs Engine.score, round-robin.

    Two ways vLLM users read the label's log-probability: prompt_logprobs with the label as the last prompt token,
    and logprob_token_ids on one generated token. The ratio is against the faster.
    """
    prompt = request.prompt_token_ids
    family = decoder(engine)
    candidates = candidate_token_lists(
        family, family.catalog, request.candidates, len(prompt), family.begin in (None, prompt[-1])
    )
    label = label_token_ids(family.tokenizer, request.labels or family.layout.labels)[0]
    base = {"task": "score", "prompt": prompt, "candidates": candidates, "label": label}
    jobs = {f"vllm_{mode}": {**base, "mode": mode} for mode in ("prompt_logprobs", "label_logprobs")}
    longest = len(prompt) + max(map(len, candidates)) + 2  # the label, then one generated token
    with _peer(engine, model_dir, device, longest, len(candidates)) as peer:
        seconds, rounds, answers = _round_robin(lambda: engine.score([request]), jobs, peer, device, repeats)
    [ours] = engine.score([request])
    mine = [s.logprob for s in ours.scores]
    fastest = min(jobs, key=seconds.get)
    return {
        **peer.ready,
        "options": peer.options,
        "seconds": seconds,
        "rounds": rounds,
        "ratios": {**_ratios(seconds, rounds, fastest), "vllm_mode": fastest},
        "ratios_per_mode": {name: _ratios(seconds, rounds, name) for name in jobs},
        "max_abs_logprob_diff": {
            name: max(abs(a - b) for a, b in zip(mine, answer["logprobs"], strict=True))
            for name, answer in answers.items()
        },
        "vllm_cached_prompt_tokens": {name: answer["cached_tokens"] for name, answer in answers.items()},
    }


def _ratios(seconds: dict, rounds: dict, job: str) -> dict:
    """vLLM over genrec by medians, and by fastest rounds (on a shared machine noise only ever adds time)."""
    return {
        "vllm_over_genrec": seconds[job] / seconds["genrec"],
        "vllm_over_genrec_fastest_rounds": min(rounds[job]) / min(rounds["genrec"]),
    }


def _peer(engine, model_dir, device, max_model_len, rows, logprobs=20) -> VllmPeer:
    dtype = str(engine.model.dtype).removeprefix("torch.")
    return VllmPeer(model_dir, engine.model.config, device, dtype, max_model_len, rows, logprobs)


def _round_robin(genrec_fn, jobs: dict, peer: VllmPeer, device: str, repeats: int, pause_s: float = 0.2):
    """Median and per-round seconds of genrec and of each peer job, one of each per round after a warm-up round.

    The short pause between calls lets the other side's spinning OpenMP threads go to sleep first.
    """
    times = {name: [] for name in ["genrec", *jobs]}
    answers = {}
    for round_ in range(repeats + 1):
        elapsed = timed(genrec_fn, device)
        for name, job in jobs.items():
            time.sleep(pause_s)
            answers[name] = peer.call(job)
            if round_:
                times[name].append(answers[name]["seconds"])
        time.sleep(pause_s)
        if round_:
            times["genrec"].append(elapsed)
    return {name: statistics.median(ts) for name, ts in times.items()}, times, answers


def _kv_cache_gib(config, max_model_len: int, rows: int) -> int:
    """GiB of KV cache for one prompt plus a private block per row, twice over (prefix-cache churn)."""
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4
    tokens = max_model_len + rows * 2 * BLOCK_SIZE
    return max(1, math.ceil(2 * per_token * tokens / 2**30))
