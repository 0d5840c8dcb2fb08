"""The prefill attention kernel chosen by measurement, on the device it runs on (docs/engine.md, 'KV memory and the
execution plan'): each candidate (`kernels.prefill_kernels`) runs the model's own head shape on a few checks against
the reference, is left out if it fails or raises, and is timed on prefill-sized calls; the fastest is kept
(FlashAttention-2 on a tie). The choice is cached per device, torch version, dtype, head shape and candidates in a
JSON file, so the engines and replicas that start after the first time nothing (the kept kernel is checked again).
An option names one instead.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from genrec.attention.kernels import AttentionKernels
from genrec.attention.varlen import Spans, varlen_reference

log = logging.getLogger(__name__)

# Timed calls, as (sequences, tokens each): one prompt of SID-GR's two contexts, and eight of the shorter (a packed
# prefill). Each is the plain causal call of prompts' own tokens, a prefill's every layer.
TIMED = ((1, 1000), (1, 5000), (8, 1000))
CACHE_FILE = "attention-choice.json"


@dataclass(frozen=True)
class HeadShape:
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Choice:
    kernels: AttentionKernels
    by: str  # "measured", "cached" or "option"
    timings_ms: dict  # each candidate's time per TIMED call ("1x5000") and in all ("total"), or why it was left out

    def describe(self) -> dict:
        return {"kernel": self.kernels.name, "by": self.by, "timings_ms": self.timings_ms}


def cuda_time_ms(fn: Callable[[], object], repeats: int = 10) -> float:
    """Mean device time of `fn` (after one untimed run), by CUDA events."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def prefill_choice(
    option: str | None,
    shape: HeadShape,
    device: torch.device,
    dtype: torch.dtype,
    candidates: dict[str, AttentionKernels],
    cache: ChoiceCache | None = None,
    timer: Callable[[str, Callable], float] | None = None,
) -> Choice:
    """The engine option `attention`'s kernel: `auto` (None) measures (`choose`, cached in `ChoiceCache.default()`
    unless `cache` is given); a name takes that kernel, refused if it does not run on this device."""
    if option in (None, "auto"):
        return choose(candidates, shape, device, dtype, cache or ChoiceCache.default(), timer)
    if option not in candidates:
        here = ", ".join(["auto", *candidates])
        raise ValueError(f"attention: {option!r} does not run on this device ({device}); here: {here}")
    return Choice(candidates[option], "option", {})


def choose(
    candidates: dict[str, AttentionKernels],
    shape: HeadShape,
    device: torch.device,
    dtype: torch.dtype,
    cache: ChoiceCache | None = None,
    timer: Callable[[str, Callable], float] | None = None,
    timed: tuple = TIMED,
) -> Choice:
    """The fastest candidate that agrees with the reference (the first, FlashAttention-2, on a tie or if none
    does); `timer(name, fn) -> ms` (default: CUDA events). A cached choice is checked again (cheap), not timed."""
    if not candidates:
        raise ValueError("attention: no prefill kernel to choose from")
    key = cache_key(device, dtype, shape, candidates)
    cached = cache.get(key) if cache else None
    kept = candidates.get(cached["kernel"]) if cached else None
    if kept is not None and not disagreement(kept, shape, device, dtype):  # an upgraded kernel is checked again
        return Choice(kept, "cached", cached["timings_ms"])
    timer = timer or (lambda name, fn: cuda_time_ms(fn))
    timings = {name: measured(name, k, shape, device, dtype, timer, timed) for name, k in candidates.items()}
    agreeing = [name for name, t in timings.items() if isinstance(t, dict)]
    if agreeing:  # the first of the fastest: FlashAttention-2 on a tie
        fastest = min(agreeing, key=lambda name: timings[name]["total"])
    else:
        log.warning("no prefill attention kernel agreed with the reference (%s); keeping the first", timings)
        fastest = next(iter(candidates))
    if cache:
        cache.put(key, {"kernel": fastest, "timings_ms": timings})
    return Choice(candidates[fastest], "measured", timings)


def measured(name: str, kernels: AttentionKernels, shape, device, dtype, timer, timed) -> dict | str:
    """Its time per timed call and in all (ms), or why it is left out: it disagrees with the reference, or a timed
    call raised (a shape the checks did not reach, memory) or gave no finite, non-negative time."""
    problem = disagreement(kernels, shape, device, dtype)
    if problem:
        return f"left out: {problem}"
    each = {}
    for n, t in timed:
        try:
            ms = float(timer(name, call(kernels, *prompts(shape, device, dtype, n, t))))
        except Exception as err:  # a kernel that cannot run a prefill of this size is not a candidate
            return f"left out: {n} x {t} tokens: {one_line(err)}"
        if not (math.isfinite(ms) and ms >= 0):
            return f"left out: {n} x {t} tokens timed {ms}"
        each[f"{n}x{t}"] = round(ms, 4)
    return each | {"total": round(sum(each.values()), 4)}


def one_line(err: Exception) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"[:200]


def cache_key(device: torch.device, dtype: torch.dtype, shape: HeadShape, candidates: dict) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    cudnn = torch.backends.cudnn.version() if device.type == "cuda" else None
    return (
        f"{name} | torch {torch.__version__} cudnn {cudnn} | {dtype} | heads {shape.heads}/{shape.kv_heads}"
        f" x {shape.head_dim} | {','.join(candidates)}"
    )


def call(kernels: AttentionKernels, q, k, v, spans: Spans, scale: float) -> Callable[[], object]:
    return lambda: kernels.varlen(q, k, v, spans, scale, causal=True, need_lse=False)


def prompts(shape: HeadShape, device, dtype, sequences: int, tokens: int, seed: int = 0):
    """q, k, v and spans of `sequences` prompts of `tokens` each, packed as a prefill pass packs them."""
    g = torch.Generator(device=device).manual_seed(seed)
    total = sequences * tokens
    q = torch.randn(total, shape.heads, shape.head_dim, device=device, generator=g).to(dtype)
    k, v = (torch.randn(total, shape.kv_heads, shape.head_dim, device=device, generator=g).to(dtype) for _ in "kv")
    starts = list(range(0, total + 1, tokens))
    return q, k, v, Spans(starts, starts[:-1], [tokens] * sequences), shape.head_dim**-0.5


def checks(shape: HeadShape, device, dtype):
    """Calls of every kind a plan makes, small enough for a float32 reference: prompts' own tokens (causal, with and
    without the log-sum-exp), chunks after earlier tokens (bottom-right causal), context reads with gaps and an
    empty sequence (no mask, log-sum-exp)."""
    q, k, v, _, scale = prompts(shape, device, dtype, 1, 700, seed=1)
    own = Spans([0, 37, 165, 465], [0, 37, 165], [37, 128, 300])
    after = Spans([0, 20, 84], [0, 100], [90, 400])
    reads = Spans([0, 5, 9, 9, 40], [3, 0, 600, 200], [90, 0, 80, 333])
    return [
        (q[:465], k, v, own, scale, True, False),
        (q[:465], k, v, own, scale, True, True),
        (q[:84], k, v, after, scale, True, True),
        (q[:40], k, v, reads, scale, False, True),
    ]


def disagreement(kernels: AttentionKernels, shape: HeadShape, device, dtype) -> str | None:
    """Why `kernels` must not be used here (it raises, answers in another shape, or differs from the float32
    reference beyond half precision's rounding), or None."""
    for q, k, v, spans, scale, causal, need_lse in checks(shape, device, dtype):
        want, want_lse = varlen_reference(q.float(), k.float(), v.float(), spans, scale, causal, need_lse)
        try:
            out, lse = kernels.varlen(q, k, v, spans, scale, causal, need_lse)
            if tuple(out.shape) != tuple(want.shape) or (need_lse and tuple(lse.shape) != tuple(want_lse.shape)):
                return f"answers in another shape (causal={causal}, lse={need_lse})"
            error = (out.float() - want).abs().max().item()
            lse_agrees = not need_lse or torch.allclose(lse.float(), want_lse, atol=0.02, rtol=0)
        except Exception as err:  # a kernel that cannot run these shapes on this device is not a candidate
            return one_line(err)
        if not error <= 0.02:
            return f"differs from the reference by {error:.3g} (causal={causal}, lse={need_lse})"
        if not lse_agrees:
            return f"its log-sum-exp differs from the reference's (causal={causal})"
    return None


class ChoiceCache:
    """The measured choices, by key, in one JSON file: read, merged and written whole under a lock (several engines
    and replicas may start at once), replaced atomically; an unreadable one is measured again and rewritten."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def default(cls) -> ChoiceCache:
        """`$GENREC_CACHE` (unset or empty: ~/.cache/genrec)/attention-choice.json."""
        return cls(Path(os.environ.get("GENREC_CACHE") or "~/.cache/genrec").expanduser() / CACHE_FILE)

    def read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError) as err:
            log.warning("ignoring the attention choices in %s (%s): measuring again", self.path, one_line(err))
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> dict | None:
        """The entry of `key` if it has the shape `put` writes."""
        entry = self.read().get(key)
        shaped = isinstance(entry, dict) and isinstance(entry.get("kernel"), str)
        return entry if shaped and isinstance(entry.get("timings_ms"), dict) else None

    def put(self, key: str, entry: dict) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_name(f".{self.path.name}.lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
                self._write(self.read() | {key: entry})
        except OSError as err:  # the choice stands; the next start measures again
            log.warning("could not keep the attention choice in %s: %s", self.path, one_line(err))

    def _write(self, data: dict) -> None:
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True, allow_nan=False)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
