"""The prepared check for a GPU session (issues 38, 47): one command, under 5 minutes on one H100 or H200, without Ray.

    PYTHONPATH=platform python -m genrec_bench.gpu_check --out gpu_check.json [--budget-s 240] [--quick]
    PYTHONPATH=platform python -m genrec_bench.gpu_check --device cpu --preset tiny --contexts 64,128  # a dry run

Before any part, Dynamo's recompile limit is raised to 64 (torch's default 8; with fullgraph=True a piece past it
raises where the engine has no fallback): what it was and is goes under "run" in the JSON. Each part's JSON is
written as it finishes ("seconds": each part's); a failing part records its error and the others go on; a part that
would start after `--budget-s` (default 240 s: the run ends within 5 minutes while its last part takes under one) is
skipped, and the timing parts take fewer repeats when less than two minutes are left, so a budget cut drops repeats
and the trailing parts, never the profiles. Parts, in order:
1. versions, and the schema of the FlashAttention-2 varlen aten op (seqused_k present?);
2. kernels: the CUDA varlen path against the plain-torch float32 reference (decode-like spans with gaps, a sequence
   without keys, GQA; causal prefill-like spans), bf16 and fp16, and the float32 reference on CUDA against the CPU
   ("skipped": "no CUDA" on a CPU); then the prefill attention kernel chosen by measurement for the preset's heads
   (FlashAttention-2, cuDNN attention, FlashAttention-3 where installed: each one's checks against the reference and
   its time per call at 1 x 1,000, 1 x 5,000 and 8 x 1,000 tokens; genrec.attention.choice), measured afresh;
3. load: the preset's engines (Qwen3-1.7B's dimensions, bf16, random weights, prefix cache off), built and started
   one at a time before any other model compiles: `fast` (`cuda_fast=True`), `fast_whole` (fast, built with
   `split_kv="off"`), `eager` (`cuda_fast=False`), `float32` (the reference the rule re-scores with, eager: nothing
   compiled for it), `fast_selecting` (decode graphs that select the beams themselves, `selects_in_graph`) and
   `fast_fp8` (the linear layers in FP8, `fp8`; these two last: a start they cannot make costs the others
   nothing). Each one's `plan.describe()`, start and warm-up
   seconds, `runner.graph_bytes`, the device memory it holds once started and its compiled pieces' fallbacks; the
   device's memory after all started; the fast engine's first request beside its second;
4. launches per decode pass and its selection (torch.profiler, 4 requests of beam 30 after 2,000 tokens): eager, FA2
   varlen, replayed as a CUDA graph (split-KV as the plan decides: `split` says which), replayed with split-KV off,
   replayed by the graphs that select; launch calls counted by kind (cudaLaunchKernel, cuLaunchKernel(Ex), ...);
5. where one request's time goes at each context (beam 256 / 3 levels; torch.profiler), the fast engine, then the
   one with split-KV off, then the fast engine's batch of 8 and 4 callers (2 requests each, one after the other) at
   the longest context: wall time, GPU busy time and idle gaps, kernel time by kind (compiled pieces = Triton
   kernels, attention, matrix products, selection, copies, other) and the kernels that took longest;
6. correctness at the preset's size, SID-GR's shape (beam 256, 3 levels, each context): every bf16 engine judged on
   its own against float32 (`judge`, below; the FP8 engine with a wider allowance, FP8_NOISE_SHARE);
7. SID-GR's shapes timed in-process from submission to result, prompt tokens given, at each context: one request, a
   batch of 8 and 4 concurrent callers (threads over an AsyncEngine), fast beside split-KV off and eager; one
   request and the batch also beside `fast_selecting` (with its beams beside the fast engine's,
   `selecting_beside_fast`) and `fast_fp8`, and one plain prefill of the same prompts (the floor);
8. `bench load --cuda-fast`'s pattern in-process, the other engines freed first: a thread making prompts (reading the
   trie on the device) and submitting requests of many widths to a fresh engine over the fast one's weights and
   plan (its own pool and captures); its errors; then 32 concurrent callers of beam 1,024 at context 1,000
   (FlashRec's shape) on another fresh engine whose pool holds them all and whose decode graphs are derived from it
   as it starts: requests per second, latency, start-up, memory, or the error (out of memory) it met; then the fast
   engine is freed too (del, gc, the CUDA cache emptied) and Dynamo's caches reset;
9. correctness of the tiny preset, qwen3 then qwen2, fast and eager each judged against float32 (eager), Dynamo's
   caches reset after each;
10. HSTU (tiny preset) at 2,000 events / 500 candidates: `genrec bench rank` in-process, and a returning user cold,
   warm under the cost rule and warm reading every cached piece, at 2,000 and 4,000 events.

`--quick` (under 2 minutes; default budget 100 s): parts 1, 2, 3 (fast, its decode graphs up to 256 rows, eager and
float32 only), 6, 7 (one request only, 3 repeats) and 9. A dry run (`--device cpu --preset tiny --contexts 64,128`)
runs every part on the CPU plan with one repeat, small pools and HSTU at 200 / 50; only part 2 is skipped
(tests/test_gpu_check_dry_run.py runs it in CI).

**The correctness rule** (`judge`). In bf16 two correct engines return different items where log-probabilities
nearly tie, so neither is compared with the other: each engine's returned items are re-scored exactly by a float32
engine restricted to them (`allowed_item_ids` = those items, `beam_width` = their number: the search keeps every
prefix, so it is exhaustive over them), and the float32 engine's own beam search gives its k-th best log-probability
t_k (k = the items returned). The bf16 noise allowance is ν = max(|t_k| / 32, 1/16): a share of the spread of the
log-probabilities from certainty (0) down to t_k. With random weights the logits are centred, so their spread sets
both the log-probabilities' size and bf16's rounding of them (unit roundoff 2^-8, accumulated over the layers):
errors of 0.5-0.8 % of |t_k| were seen (the tiny preset on a CPU and an H200, Qwen3-1.7B's dimensions on an H200),
a quarter of the allowance; 1/16 is a floor for peaked distributions whose t_k is near 0. The engine is right when
  (1) every returned item's own log-probability is within ν of its exact one (it reports its own item's score: a
      result whose scores are shuffled among its items fails), and
  (2) every returned item's exact log-probability is at least t_k - ν (each is among the k best within noise: the
      items of a broken engine fail).
A CPU test holds the rule to that: a bf16 engine passes, a broken one and a shuffled result fail.

Also `genrec bench suite` (`run_suite`): the benchmark runs a device is asked for, in priority order, one JSON file
each. Each run is isolated: a failure is written as its own JSON and the suite goes on, so a time-limited device
session still returns everything that finished.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from genrec.api import Candidate, RetrieveRequest, ScoreRequest
from genrec.attention import Spans, flash_varlen, varlen_reference
from genrec.attention.choice import ChoiceCache, HeadShape, choose
from genrec.attention.kernels import prefill_kernels
from genrec.engine import AsyncEngine, Engine, SchedulerConfig
from genrec.testing.tiny import ModelSpec, preset, write_model_dir
from genrec_bench.cli import LoadOptions, RankOptions, RetrieveOptions, ScoreOptions, SuiteOptions
from genrec_bench.common import (
    decoder,
    hstu_preset_dir,
    interleaved_medians,
    model_dir_for,
    random_prompt,
    synchronize,
    timed,
)

# -- 1, 2: versions and kernels ----------------------------------------------------------------------------------


def versions() -> dict:
    op = torch.ops.aten._flash_attention_forward.default
    schema = str(op._schema)
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "schema": schema}
    info["schema_has_seqused_k"] = "seqused_k" in schema
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def _case(device, dtype, causal: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    KV, G, D, T = 8, 2, 128, 4096  # Qwen3-1.7B: 16 query heads, 8 KV heads, head_dim 128
    k = torch.randn(T, KV, D, generator=g).to(device, dtype)
    v = torch.randn(T, KV, D, generator=g).to(device, dtype)
    if causal:  # prefill chunks: queries = the last tokens of each prompt span
        cu_q, starts, lengths = [0, 300, 300 + 37, 300 + 37 + 5], [100, 1000, 3000], [300, 500, 5]
    else:  # decode rows: many rows per request, gaps between contexts, one request without context
        cu_q, starts, lengths = (
            [0, 30, 30 + 256, 30 + 256 + 3, 30 + 256 + 3 + 7],
            [0, 2100, 3500, 0],
            [2000, 1000, 1, 0],
        )
    q = torch.randn(cu_q[-1], KV * G, D, generator=g).to(device, dtype)
    return q, k, v, Spans(cu_q, starts, lengths)


def varlen_checks(device) -> dict:
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        for causal in (False, True):
            q, k, v, spans = _case(device, dtype, causal, 7)
            want, want_lse = varlen_reference(q.float().cpu(), k.float().cpu(), v.float().cpu(), spans, 0.088, causal)
            got, lse = flash_varlen(q, k, v, spans, 0.088, causal)
            torch.cuda.synchronize()
            eager, _ = varlen_reference(q, k, v, spans, 0.088, causal)
            key = f"{str(dtype).split('.')[-1]}_{'causal' if causal else 'decode'}"
            finite = torch.isfinite(want_lse)
            out[key] = {
                "max_abs_out_vs_cpu_f32": (got.float().cpu() - want).abs().max().item(),
                "max_abs_out_eager_vs_cpu_f32": (eager.float().cpu() - want).abs().max().item(),
                "max_abs_lse_vs_cpu_f32": (lse.cpu()[finite] - want_lse[finite]).abs().max().item(),
                "no_key_rows_lse_is_-inf": bool((lse.cpu()[~finite] == float("-inf")).all()),
            }
            out[key]["ok"] = out[key]["max_abs_out_vs_cpu_f32"] < 2e-2 and out[key]["max_abs_lse_vs_cpu_f32"] < 1e-2
    q, k, v, spans = _case(device, torch.float32, False, 8)
    got, lse = varlen_reference(q, k, v, spans, 0.088)
    want, want_lse = varlen_reference(q.cpu(), k.cpu(), v.cpu(), spans, 0.088)
    out["float32_cuda_reference_vs_cpu"] = (got.cpu() - want).abs().max().item()
    return out


def attention_choice(device, preset_name: str) -> dict:
    """The prefill kernel `auto` chooses for the preset's heads in bfloat16, measured afresh (a cache of its own):
    each candidate's checks and times per call (genrec.attention.choice), as an engine's start measures them."""
    spec = preset(preset_name)
    shape, device = HeadShape(spec.heads, spec.kv_heads, spec.head_dim), torch.device(device)
    with tempfile.TemporaryDirectory() as folder:
        choice = choose(prefill_kernels(device), shape, device, torch.bfloat16, ChoiceCache(Path(folder) / "c.json"))
    return {"heads": dataclasses.asdict(shape)} | choice.describe()


KV_BUDGET = 8 << 30  # bytes of KV pool per bf16 engine: 8 contexts of 5,000 tokens and their beams fit
REFERENCE_KV_BUDGET = 3 << 30  # the float32 reference: one request at a time (5,000 tokens: 1.1 GiB) and its beams
TINY_KV_BUDGET = 1 << 30  # the tiny presets' engines
LOAD_KV_BUDGET = 2 << 30  # the load pattern's engine: prompts of at most 1,076 tokens
CPU_KV_BUDGET = 256 << 20  # any pool of a CPU dry run (tiny models)
SID_GR_WIDTH, SID_GR_LEVELS = 256, 3  # SID-GR's headline shape: beam 256, 3 tokens, contexts 1,000 and 5,000
RECOMPILE_LIMIT = 64  # Dynamo's cache entries per code object (torch's default: 8), set before any part
# --budget-s's defaults: no part starts later, so a run ends within 5 (--quick: 2) minutes when its last part takes
# under a minute (--quick: 20 s).
BUDGET_S, QUICK_BUDGET_S = 240.0, 100.0


def on_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def cold(device, kv_bytes: int = KV_BUDGET) -> SchedulerConfig:
    """The prefix cache off (rounds repeat) and a KV pool of `kv_bytes` (a CPU dry run's: at most CPU_KV_BUDGET)."""
    return SchedulerConfig(prefix_cache_bytes=0, kv_budget_bytes=kv_bytes if on_cuda(device) else CPU_KV_BUDGET)


# -- the correctness rule (parts 6 and 9) ----------------------------------------------------------------------------

NOISE_SHARE = 1 / 32  # ν = NOISE_SHARE * |t_k|, at least NOISE_FLOOR (the module's docstring says why)
# An FP8 engine's share: e4m3 rounds at 2^-4 where bf16 rounds at 2^-8. On a CPU (tiny model) its errors were ~1/32
# of |t_k|, as the bf16 allowance; 1/8 keeps bf16's margin of about four.
FP8_NOISE_SHARE = 1 / 8
NOISE_FLOOR = 1 / 16


def judge(
    returned: list[tuple[str, float]], exact: dict[str, float], kth_best: float, share: float = NOISE_SHARE
) -> dict:
    """The rule (module docstring): `returned` (item, its own log-probability) by the engine judged, `exact` those
    items' float32 log-probabilities (restricted, exhaustive), `kth_best` the float32 beam search's k-th best;
    `share` of |kth_best| the noise allowed (an FP8 engine's: FP8_NOISE_SHARE)."""
    noise = max(abs(kth_best) * share, NOISE_FLOOR)
    missing = [item for item, _ in returned if item not in exact]
    found = [(item, logprob) for item, logprob in returned if item in exact]
    error = max((abs(logprob - exact[item]) for item, logprob in found), default=0.0)
    shortfall = max((kth_best - exact[item] for item, _ in found), default=0.0)
    return {
        "ok": bool(returned) and not missing and error <= noise and shortfall <= noise,
        "noise": noise,
        "max_logprob_error": error,  # (1): at most the noise
        "max_shortfall_below_kth_best": shortfall,  # (2): at most the noise
        "missing": missing[:5],
    }


def exact_logprobs(reference: Engine, request: RetrieveRequest, items: list[str]) -> dict[str, float]:
    """The items' exact log-probabilities after the request's prompt: `reference` restricted to them, its beam as
    wide as they are many (every prefix kept: exhaustive)."""
    distinct = list(dict.fromkeys(items))
    fields = request.model_dump() | {"allowed_item_ids": distinct, "beam_width": len(distinct), "num_results": None}
    (result,) = reference.retrieve([RetrieveRequest.model_validate(fields)])
    return {i.item_id: i.logprob for i in result.items}


def judged(engines: dict[str, Engine], reference: Engine, request: RetrieveRequest) -> dict:
    """Each engine's answer to the request judged against the float32 `reference` on its own."""
    (truth,) = reference.retrieve([request])
    kth_best = min(i.logprob for i in truth.items)
    best = {i.item_id for i in truth.items}
    out = {"kth_best_float32": kth_best}
    for name, engine in engines.items():
        (result,) = engine.retrieve([request])
        returned = [(i.item_id, i.logprob) for i in result.items]
        exact = exact_logprobs(reference, request, [item for item, _ in returned])
        share = FP8_NOISE_SHARE if engine.plan.fp8 else NOISE_SHARE
        verdict = judge(returned, exact, kth_best, share)
        verdict["overlap_with_float32"] = len(best & {item for item, _ in returned}) / max(len(best), 1)
        out[name] = verdict
    out["ok"] = all(out[name]["ok"] for name in engines)
    return out


def tiny_judged(device, architecture: str = "qwen3") -> dict:
    """The tiny preset (3 levels) of the decoder architecture, bf16, fast and eager, judged against float32 (an
    eager engine: nothing compiled for it)."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / "tiny", preset("tiny", architecture=architecture, levels=3))
        kw = {"device": device, "scheduler": cold(device, TINY_KV_BUDGET)}
        engines = {
            "fast": Engine.from_pretrained(model_dir, dtype=torch.bfloat16, cuda_fast=True, **kw),
            "eager": Engine.from_pretrained(model_dir, dtype=torch.bfloat16, cuda_fast=False, **kw),
        }
        reference = Engine.from_pretrained(model_dir, dtype=torch.float32, cuda_fast=False, **kw)
        g = torch.Generator().manual_seed(3)
        out = {
            f"{n}/{w}": judged(
                engines, reference, RetrieveRequest(prompt_token_ids=random_prompt(reference, n, g), beam_width=w)
            )
            for n, w in ((200, 30), (57, 256), (1000, 100))
        }
        out["ok"] = all(part["ok"] for part in out.values())
        out["plans"] = {name: e.plan.describe() for name, e in {**engines, "float32": reference}.items()}
        return out


def agreement(a: Engine, b: Engine, retrieve: list, score: list) -> tuple[list[bool], float, float]:
    """Two engines on the same requests: per retrieve request, the same items or not; the largest difference of
    their beams' log-probabilities and of their scores."""
    same, beams = beams_agree(a, b, retrieve)
    s0, s1 = a.score(score), b.score(score)
    scores = max(abs(i.logprob - j.logprob) for i, j in zip(s0[0].scores, s1[0].scores, strict=True))
    return same, beams, scores


def beams_agree(a: Engine, b: Engine, retrieve: list) -> tuple[list[bool], float]:
    """Per request, whether both return the same items; the largest difference of their beams' log-probabilities."""
    r0, r1 = a.retrieve(retrieve), b.retrieve(retrieve)
    same = [[i.item_id for i in x.items] == [i.item_id for i in y.items] for x, y in zip(r0, r1, strict=True)]
    beams = max(
        abs(i.logprob - j.logprob) for x, y in zip(r0, r1, strict=True) for i, j in zip(x.items, y.items, strict=False)
    )
    return same, beams


# -- 3: the preset's engines -----------------------------------------------------------------------------------------

# Built and started in this order, one at a time, before any other model: the fast path; the fast path with
# split-KV off (an engine built so, not a mutated plan); eager; the float32 reference (eager: nothing compiled for
# it); the fast path selecting inside its decode graphs, last (a capture it cannot make costs the others nothing).
# The fast engines capture up to 2,048 rows, the widest pass the parts make (8 requests of beam 256): the derived
# default (8 requests of beam 1,024 where memory allows) would spend start-up time on captures no part replays.
WIDEST = {"cuda_graph_max_rows": 2048}
ENGINE_OPTIONS = {
    "fast": {"cuda_fast": True, **WIDEST},
    "fast_whole": {"cuda_fast": True, "split_kv": "off", **WIDEST},
    "eager": {"cuda_fast": False},
    "float32": {"cuda_fast": False, "dtype": torch.float32},
    "fast_selecting": {"cuda_fast": True, "selects_in_graph": True, **WIDEST},
    "fast_fp8": {"cuda_fast": True, "fp8": True, **WIDEST},
}
QUICK_ENGINES = ("fast", "eager", "float32")  # --quick's; also the ones every later part of the preset needs
# --quick times one request of beam 256: its fast engine captures the decode passes of up to 256 rows only.
QUICK_OPTIONS = {"fast": {"cuda_graph_max_rows": 256}}


def build_engine(model_dir: Path, name: str, device, **overrides) -> Engine:
    options = ENGINE_OPTIONS[name] | overrides
    dtype = options.pop("dtype", torch.bfloat16)
    kv_bytes = REFERENCE_KV_BUDGET if dtype == torch.float32 else KV_BUDGET
    return Engine.from_pretrained(model_dir, device=device, dtype=dtype, scheduler=cold(device, kv_bytes), **options)


def gpu_memory(device) -> dict | None:
    """The device's memory now (GiB): torch's allocated, reserved and peak allocated; the driver's free and total."""
    if not on_cuda(device):
        return None
    free, total = torch.cuda.mem_get_info(device)
    gib = {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "peak_allocated": torch.cuda.max_memory_allocated(device),
        "free": free,
        "total": total,
    }
    return {f"{name}_gib": round(n / 2**30, 2) for name, n in gib.items()}


def compiled_fallbacks(engine: Engine) -> int | None:
    """Calls of its compiled pieces that ran plain, past Dynamo's recompile limit (None: nothing compiled)."""
    if not engine.plan.compiles:
        return None
    pieces = engine.plan.ops.pieces
    return sum(getattr(getattr(pieces, f.name), "fallbacks", 0) for f in dataclasses.fields(pieces))


def loaded(big: dict, device, preset_name: str, names=tuple(ENGINE_OPTIONS), overrides: dict | None = None) -> dict:
    """The preset's engines, each built and started before the next (its captures, compiles and warm-up requests):
    its plan, `start_s` (build and start), `warmup_s`, `graph_bytes` (the device memory its captures took), the
    device memory it holds once started and its compiled pieces' fallbacks; the device's memory after all started;
    then the fast one's first request at 1000/256/3 beside its second: nothing should compile or capture on the
    first. An engine outside QUICK_ENGINES that cannot start is reported and left out."""
    model_dir = model_dir_for(preset_name, None, SID_GR_LEVELS)
    if on_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)
    started = {}
    for name in names:
        before, start = torch.cuda.memory_allocated(device) if on_cuda(device) else 0, time.perf_counter()
        try:
            engine = build_engine(model_dir, name, device, **(overrides or {}).get(name, {}))
            if not engine.scheduler.idle:  # made on first use: captures, compiles, warm-up requests
                raise RuntimeError(f"{name}: a request is running before any was submitted")
        except Exception as err:  # noqa: BLE001 - an optional engine that cannot start is reported and left out
            if name in QUICK_ENGINES:
                raise
            started[name], engine = {"error": f"{type(err).__name__}: {err}"[:2000]}, None
        if engine is None:
            release({}, device, reset=False)  # what it held, once the error's frames are gone
            continue
        big[name] = engine
        held = torch.cuda.memory_allocated(device) - before if on_cuda(device) else None
        started[name] = {
            "options": {k: str(v) for k, v in (ENGINE_OPTIONS[name] | (overrides or {}).get(name, {})).items()},
            "plan": engine.plan.describe(),
            "start_s": round(time.perf_counter() - start, 2),
            "warmup_s": engine.runner.warmup_s,
            "graph_bytes": engine.runner.graph_bytes,
            "gpu_memory_gib": None if held is None else round(held / 2**30, 2),
            "compiled_fallbacks": compiled_fallbacks(engine),
        }
    memory = gpu_memory(device)  # after every engine started: weights, KV pools, captures
    (request,) = sid_gr_requests(big["fast"], 1000 if on_cuda(device) else 64, count=1)
    first, second = (timed(lambda: big["fast"].retrieve([request]), device) for _ in range(2))
    return {
        "model_dir": str(model_dir),
        "engines": list(big),
        "started": started,
        "gpu_memory_after_start": memory,
        "fast_first_request_s": first,
        "fast_second_request_s": second,
    }


def release(engines: dict, device, reset: bool = True) -> dict:
    """Free `engines` (cleared), the device's cached blocks, and with `reset` Dynamo's caches (between model sizes:
    the next model's pieces compile afresh, within the recompile limit). Returns their compiled pieces' fallbacks,
    their bucketed decode passes that found no captured graph (none expected) and the device's memory after."""
    fallbacks = {name: compiled_fallbacks(engine) for name, engine in engines.items()}
    uncaptured = {name: engine.runner.uncaptured_passes for name, engine in engines.items()}
    engines.clear()
    gc.collect()  # an AsyncEngine and its engine refer to each other: their KV pools go back now
    if on_cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    if reset:
        from torch import _dynamo

        _dynamo.reset()
    return {
        "compiled_fallbacks": fallbacks,
        "uncaptured_passes": uncaptured,
        "dynamo_reset": reset,
        "gpu_memory": gpu_memory(device),
    }


def compile_headroom(limit: int = RECOMPILE_LIMIT) -> dict:
    """Dynamo's recompile limit raised to `limit` (torch's default 8: with fullgraph=True a piece past it raises
    where the engine has no fallback). Returns what it was and what it is now."""
    from torch import _dynamo

    config = _dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    was = getattr(config, name)
    setattr(config, name, max(was, limit))
    accumulated = getattr(config, "accumulated_recompile_limit", getattr(config, "accumulated_cache_size_limit", None))
    return {
        "setting": f"torch._dynamo.config.{name}",
        "was": was,
        "now": getattr(config, name),
        "accumulated_recompile_limit": accumulated,
    }


# -- 4: launches per decode pass ---------------------------------------------------------------------------------


def pooled_cohorts(engine, prepared: list, pool):
    """One cohort per prepared beam request as the scheduler makes them: contexts and BeamKV slots in `pool`."""
    from genrec.engine.beam import request_width, slots_needed, start_cohort

    cohorts = []
    for p in prepared:
        ctx = pool.context(len(p.token_ids))
        logits = engine.runner.prefill([(p, ctx, 0, len(p.token_ids))])
        slots = pool.reserve(slots_needed(decoder(engine).trie, [request_width(p.request)]))  # a schedule's own
        cohorts.append(start_cohort(p.served.device_trie(), [p], [ctx], logits, slots=slots))
    return cohorts


def _cohorts(engine, prompt_len, beams):
    """Fresh cohorts of `beams` widths in the engine's own pool: the one its decode graphs were captured for."""
    g = torch.Generator().manual_seed(5)
    prepared = [
        engine.prepare(RetrieveRequest(prompt_token_ids=random_prompt(engine, prompt_len, g), beam_width=width))
        for width in beams
    ]
    return pooled_cohorts(engine, prepared, engine.scheduler.budget.pool)


def device_kernels(prof) -> list:
    """The kernels a torch.profiler profile saw run on the device."""
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


# Host calls that launch one kernel: the runtime's and the driver's, the extended forms included (Triton launches
# its kernels with cuLaunchKernelEx).
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchKernelEx", "cuLaunchKernel", "cuLaunchKernelEx")


def launch_counts(prof) -> dict:
    """A profile's device kernels, kernel launch calls (each kind of call counted) and CUDA graph launches."""
    names = [e.name for e in prof.events()]
    by_call = {call: names.count(call) for call in LAUNCH_CALLS}
    return {
        "kernels": len(device_kernels(prof)),
        "launch_calls": sum(by_call.values()),
        "launch_calls_by_call": {call: n for call, n in by_call.items() if n},
        "graph_launches": names.count("cudaGraphLaunch"),
    }


# Which engine each mode of a decode pass runs on, and whether bucketed (the captured graphs where there are).
DECODE_MODES = {
    "eager": ("eager", False),
    "varlen": ("fast", False),  # the fast engine's kernels (FA2), not replayed
    "graphs": ("fast", True),
    "graphs_split_off": ("fast_whole", True),
    "graphs_selecting": ("fast_selecting", True),
}


def launches_per_decode_pass(engines: dict[str, Engine], prompt_len: int, beams: list[int], device) -> dict:
    """Kernels and launch calls of one decode pass and its selection (torch.profiler): the `eager` engine; the `fast`
    one eagerly (FA2 varlen); the pass replayed as a CUDA graph, split-KV as the plan decides (`graphs`, `split`
    says which) and off; and replayed by the engine whose graphs select. Also each against eager (logprobs, items)."""
    from torch.profiler import ProfilerActivity, profile

    from genrec.engine.beam import fetch_finals

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda(device) else [])
    out, finals = {}, {}
    for mode, (name, bucketed) in DECODE_MODES.items():
        if name not in engines:
            continue
        engine = engines[name]
        cohorts = _cohorts(engine, prompt_len, beams)
        engine.runner.decode(cohorts, bucketed)  # warm-up (graphs were captured at the engine's start)
        split = engine.runner._splits(cohorts)
        synchronize(device)
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            engine.runner.decode(cohorts, bucketed)
            synchronize(device)
            seconds = time.perf_counter() - start
        while not all(c.done for c in cohorts):
            engine.runner.decode([c for c in cohorts if not c.done], bucketed)
        finals[mode] = fetch_finals(cohorts)
        out[mode] = {**launch_counts(prof), "seconds": seconds, "split": split}
    for mode in [m for m in finals if m != "eager"]:
        same = [a[1] == b[1] for a, b in zip(finals["eager"], finals[mode], strict=True)]
        diff = max(
            max(abs(x - y) for x, y in zip(a[0], b[0], strict=True))
            for a, b in zip(finals["eager"], finals[mode], strict=True)
        )
        out[f"{mode}_items_equal_eager"], out[f"{mode}_max_score_diff"] = same, diff
    return out


# -- 5: where the time goes --------------------------------------------------------------------------------------

# Kernel kinds by name, first match wins: Inductor's compiled pieces (Triton kernels: named triton_..., whatever
# they fuse, a cat or a gather included), FlashAttention, cuBLAS / CUTLASS products, the beam selection's sorts and
# gathers, copies and casts.
KERNEL_KINDS = (
    ("attention", ("flash", "fmha")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "splitk")),
    ("selection", ("topk", "sort", "radix", "scan", "gather", "index", "softmax", "logsumexp")),
    ("copy", ("copy", "memcpy", "memset", "fill", "cat")),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    if lowered.startswith("triton"):
        return "compiled"
    return next((kind for kind, words in KERNEL_KINDS if any(w in lowered for w in words)), "other")


def sid_gr_requests(engine: Engine, context: int, count: int = 8) -> list[RetrieveRequest]:
    g = torch.Generator().manual_seed(context)
    width = SID_GR_WIDTH
    return [RetrieveRequest(prompt_token_ids=random_prompt(engine, context, g), beam_width=width) for _ in range(count)]


WORKLOADS = ("one", "batch_8", "callers_4")  # where_time_goes's: SID-GR's three shapes


def where_time_goes(engine: Engine, context: int, device, workload: str = "one") -> dict:
    """A workload at `context`/256/3 under torch.profiler, after a warm-up: one request, a batch of 8, or 4 callers
    each submitting 2 requests one after the other over an AsyncEngine (so requests arrive while others decode).
    Wall time, the GPU's busy time (the union of its kernels' intervals) and idle gaps (host work between passes),
    kernel time by kind, and the ten kernels that took longest."""
    from torch.profiler import ProfilerActivity, profile

    with contextlib.ExitStack() as stack:
        run = _workload(engine, context, workload, stack)
        run()
        synchronize(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda(device) else [])
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            run()
            synchronize(device)
            wall_ms = (time.perf_counter() - start) * 1e3
    kernels = device_kernels(prof)
    busy_us, end = 0.0, float("-inf")
    for interval in sorted((e.time_range.start, e.time_range.end) for e in kernels):
        busy_us += max(0.0, interval[1] - max(interval[0], end))
        end = max(end, interval[1])
    by_kind, by_name = {}, {}
    for e in kernels:
        kind, us = kernel_kind(e.name), e.time_range.elapsed_us()
        by_kind[kind] = by_kind.get(kind, 0.0) + us / 1e3
        by_name[e.name[:120]] = by_name.get(e.name[:120], 0.0) + us / 1e3
    return {
        "plan": engine.plan.describe(),
        "workload": workload,
        "wall_ms": wall_ms,
        "gpu_busy_ms": busy_us / 1e3,
        "gpu_idle_ms": wall_ms - busy_us / 1e3,
        **launch_counts(prof),
        "kernel_ms_by_kind": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "longest_kernels_ms": {k: round(v, 3) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:10]},
    }


def _workload(engine: Engine, context: int, workload: str, stack: contextlib.ExitStack):
    """A call that runs `workload` (WORKLOADS) on `engine` to its end."""
    requests = sid_gr_requests(engine, context, count={"one": 1, "batch_8": 8, "callers_4": 8}[workload])
    if workload != "callers_4":
        return lambda: engine.retrieve(requests)
    driver = stack.enter_context(driven(engine))
    callers = stack.enter_context(ThreadPoolExecutor(4))

    def caller(first: int) -> None:
        for request in requests[first::4]:
            driver.submit(request, kind="retrieve").result()

    return lambda: list(callers.map(caller, range(4)))


# -- 6: correctness at the preset's size -------------------------------------------------------------------------


def big_judged(big: dict[str, Engine], contexts: list[int]) -> dict:
    """SID-GR's shape: one request per context, each bf16 engine that started (fast, split-KV off, eager, selecting
    inside its graphs) judged against float32."""
    arms = {name: engine for name, engine in big.items() if name != "float32"}
    out = {str(n): judged(arms, big["float32"], sid_gr_requests(big["fast"], n, 1)[0]) for n in contexts}
    out["ok"] = all(part["ok"] for part in out.values())
    return out


# -- 7: SID-GR's shapes, timed -----------------------------------------------------------------------------------


# The arms timed beside the fast engine, and the name of their ratio over it.
ARMS = {"fast_whole": "whole_over_split", "fast_selecting": "selecting_over_fast", "fast_fp8": "fp8_over_fast"}


def sid_gr_timed(big: dict[str, Engine], context: int, device, repeats: int = 5, full: bool = True) -> dict:
    """One request, a batch of 8 and 4 concurrent callers: fast beside split-KV off (`fast_whole`) and eager, one
    plain prefill of the same prompts (the floor); one request and the batch also beside the fast engine that selects
    inside its graphs, where they started. `full=False` (--quick): one request only. Seconds are medians of
    `repeats` (the batch: 2 fewer), from submission to result."""
    fast, eager = big["fast"], big["eager"]
    arms = {name: big[name] for name in ARMS if name in big}
    requests = sid_gr_requests(fast, context)
    prepared = [fast.prepare(r) for r in (requests if full else requests[:1])]
    one = interleaved_medians(
        {
            "fast": lambda: fast.retrieve(requests[:1]),
            **{name: lambda e=e: e.retrieve(requests[:1]) for name, e in arms.items()},
            "eager": lambda: eager.retrieve(requests[:1]),
            "one_prefill": lambda: fast.runner.prefill_alone(prepared[0]),
        },
        repeats,
        device,
    )
    report = {"repeats": repeats, "one_request_s": one}
    ratios = report["ratios"] = {
        "one_fast_over_prefill": one["fast"] / one["one_prefill"],
        "one_eager_over_fast": one["eager"] / one["fast"],
    }
    ratios |= beside_fast("one", one)
    if not full:
        return report
    batch = report["batch_8_s"] = interleaved_medians(
        {
            "fast": lambda: fast.retrieve(requests),
            **{name: lambda e=e: e.retrieve(requests) for name, e in arms.items()},
            "eager": lambda: eager.retrieve(requests),
            "one_prefill_each": lambda: [fast.runner.prefill_alone(p) for p in prepared],
        },
        max(1, repeats - 2),
        device,
    )
    callers = ("fast", "fast_whole", "eager")
    concurrent = report["concurrent_4"] = {
        name: callers_rate(big[name], requests, each=min(4, repeats)) for name in callers if name in big
    }
    ratios["batch_fast_over_prefills"] = batch["fast"] / batch["one_prefill_each"]
    ratios["batch_eager_over_fast"] = batch["eager"] / batch["fast"]
    ratios["concurrent_fast_over_eager_rate"] = (
        concurrent["fast"]["requests_per_s"] / concurrent["eager"]["requests_per_s"]
    )
    ratios |= beside_fast("batch", batch)
    if "fast_whole" in arms:
        ratios["concurrent_split_over_whole_rate"] = (
            concurrent["fast"]["requests_per_s"] / concurrent["fast_whole"]["requests_per_s"]
        )
    if "fast_selecting" in arms:
        report["selecting_beside_fast"] = same_beams(fast, arms["fast_selecting"], requests)
    return report


def beside_fast(shape: str, seconds: dict) -> dict:
    """Each arm that ran at `shape` ("one", "batch") over the fast engine's seconds: `{shape}_{ARMS[arm]}`."""
    return {f"{shape}_{label}": seconds[arm] / seconds["fast"] for arm, label in ARMS.items() if arm in seconds}


def same_beams(a: Engine, b: Engine, requests: list[RetrieveRequest]) -> dict:
    """Two engines of the same kernels and dtype (the eager selection and the one inside the graph) on the same
    requests: how many return the same items, and the largest logprob difference. Information, not a verdict: where
    candidates tie exactly at a level's cut (bf16 logits often do), each keeps another of them and both are right
    (the verdict is part 6's rule, against float32)."""
    same, beams = beams_agree(a, b, requests)
    return {"same_items": sum(same), "of": len(same), "max_logprob_diff": beams}


@contextlib.contextmanager
def driven(engine: Engine):
    """An AsyncEngine driving `engine` itself (its runner, its captured graphs, its KV pool); shut down after, when
    the engine's synchronous API serves again."""
    async_engine = AsyncEngine(engine)
    try:
        yield async_engine
    finally:
        async_engine.shutdown()


def callers_rate(engine: Engine, requests: list[RetrieveRequest], callers: int = 4, each: int = 4) -> dict:
    """`callers` threads, each submitting a request and waiting for it, `each` times, over an AsyncEngine driving
    the engine: requests per second, and latency. One round first, untimed."""
    with driven(engine) as async_engine:

        def caller(first: int, count: int) -> list[float]:
            seconds = []
            for j in range(count):
                start = time.perf_counter()
                async_engine.submit(requests[(first + j) % len(requests)], kind="retrieve").result()
                seconds.append(time.perf_counter() - start)
            return seconds

        with ThreadPoolExecutor(callers) as pool:
            list(pool.map(caller, range(callers), [1] * callers))  # warm-up: the shapes of 4 at once
            start = time.perf_counter()
            latencies = [s for part in pool.map(caller, range(callers), [each] * callers) for s in part]
            wall = time.perf_counter() - start
    return {
        "requests": len(latencies),
        "requests_per_s": len(latencies) / wall,
        "p50_s": statistics.median(latencies),
        "max_s": max(latencies),
    }


# -- 8: bench load's pattern -------------------------------------------------------------------------------------


def load_pattern(engine: Engine, device, seconds: float = 6.0, timeout_s: float = 90.0) -> dict:
    """`bench load --cuda-fast`'s pattern in-process: this thread makes prompts (reading the trie on the device, as
    its request maker does) and submits requests of many beam widths, while an engine loop replays the decode graphs:
    a fresh engine over the weights and plan of `engine`, with a pool of its own (its graphs captured as it starts).
    Records every request's error."""
    pool = cold(device, LOAD_KV_BUDGET).kv_budget_bytes
    config = SchedulerConfig(max_queue=4096, request_timeout_s=600, prefix_cache_bytes=0, kv_budget_bytes=pool)
    serving = Engine(engine.family, config, engine.model_version, plan=engine.plan)
    widths, g = (1, 3, 8, 30, 64, 100, 256, 17), torch.Generator().manual_seed(7)
    futures, errors = [], []
    with driven(serving) as async_engine:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            prompt = random_prompt(engine, 300 + 97 * (len(futures) % 9), g)
            width = widths[len(futures) % len(widths)]
            futures.append(
                async_engine.submit(RetrieveRequest(prompt_token_ids=prompt, beam_width=width), timeout_s, "retrieve")
            )
            time.sleep(0.05)
        done_by = time.perf_counter() + timeout_s
        for future in futures:
            try:
                future.result(timeout=max(0.0, done_by - time.perf_counter()))
            except Exception as err:  # noqa: BLE001 - recorded: what this part is for
                errors.append(f"{type(err).__name__}: {err}"[:300])
    return {
        "plan": serving.plan.describe(),
        "submitted": len(futures),
        "errors": len(errors),
        "first_errors": errors[:3],
        "ok": not errors,
    }


# -- 8: many wide requests at once ------------------------------------------------------------------------------

WIDE_CALLERS = {"callers": 32, "beam": 1024, "context": 1000}  # FlashRec's shape (RTX 5090, beam 1,000): 24.6 req/s
WIDE_CALLERS_DRY = {"callers": 4, "beam": 64, "context": 64}  # a CPU dry run's


def wide_callers(engine: Engine, device, callers: int, beam: int, context: int) -> dict:
    """`callers` concurrent callers of beam `beam` at context `context` (peers fail at beam >= 512 with 8 or more
    callers; SID-GR ran out of memory at beam 1,024 until it shared its graphs' pool): a fresh engine over the fast
    one's weights and plan, its KV pool sized for every caller's context and beams at once and its decode graphs
    derived from that pool and the memory left (genrec.engine.capture_size) as it starts. Requests per second and
    latency, its start (captures, warm-up) and memory; an error (out of memory included) is recorded, not raised."""
    levels = engine.family.levels
    tokens = callers * (context + beam * levels)
    config = SchedulerConfig(
        max_running=callers,
        max_queue=4 * callers,
        request_timeout_s=600,
        prefix_cache_bytes=0,
        kv_budget_bytes=tokens * engine.runner.new_pool(1).bytes_per_token,
    )
    g = torch.Generator().manual_seed(11)
    requests = [RetrieveRequest(prompt_token_ids=random_prompt(engine, context, g), beam_width=beam) for _ in range(8)]
    report = {"callers": callers, "beam": beam, "context": context, "levels": levels, "pool_tokens": tokens}
    started = time.perf_counter()
    try:
        serving = Engine(engine.family, config, engine.model_version, plan=engine.plan)
        serving.start()
        report |= {"start_s": round(time.perf_counter() - started, 2), "execution": serving.describe_execution()}
        report["gpu_memory_after_start"] = gpu_memory(device)
        report |= callers_rate(serving, requests, callers=callers, each=1)
        report["gpu_memory_after"] = gpu_memory(device)
    except Exception as err:  # noqa: BLE001 - recorded: whether it fits is what this part is for
        report["error"] = f"{type(err).__name__}: {err}"[:2000]
    finally:
        serving = None
        release({}, device, reset=False)
    report["ok"] = "error" not in report
    return report


# -- 10: HSTU ----------------------------------------------------------------------------------------------------


def hstu(device, events: int = 2000, candidates: int = 500, repeats: int = 5) -> dict:
    """`genrec bench rank` at `events` / `candidates` on the device (its plain-forward baseline included), and a
    returning user (10 events more per visit) cold, warm under the cost rule, and warm reading every piece, at
    `events` and twice as many."""
    from genrec_bench import engine as benches

    options = RankOptions(device=device, events=events, candidates=candidates, repeats=repeats, fanout_sample=5)
    out = {"bench_rank": benches.rank(options)}
    ranker = Engine.from_pretrained(hstu_preset_dir("tiny"), device=device, scheduler=cold(device, TINY_KV_BUDGET))
    for n in (events, 2 * events):
        request = benches.rank_request(ranker, n, candidates)
        out[f"returning {n}/{candidates}"] = benches.warm_and_cold(
            ranker, request, 10, repeats, device, every_piece=True
        )
    return out


# -- the run -----------------------------------------------------------------------------------------------------


class Report:
    """The parts' results, rewritten to `path` after each part; a part records its error instead of raising, and
    one that would start after the deadline (or has a reason to be skipped) is skipped. `run`: the settings and
    the order the parts ran in; `seconds`: each part's."""

    def __init__(self, path: Path, budget_s: float, device):
        self.path, self.budget_s, self.device = path, budget_s, device
        self.deadline = time.perf_counter() + budget_s
        self.parts = {"run": {"budget_s": budget_s, "order": []}, "seconds": {}}
        path.parent.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def repeats(self, full: int) -> int:
        """Timing repeats for a part starting now: `full` with two minutes of the budget left, half with one, then
        one; a CPU dry run: one. A budget cut drops repeats before it drops parts."""
        if not on_cuda(self.device):
            return 1
        left = self.left()
        return full if left >= 120 else max(1, full // 2) if left >= 60 else 1

    def note(self, name: str, value) -> None:
        self.parts["run"][name] = value
        self.write()

    def part(self, name: str, fn, skip: str | None = None):
        start, result = time.perf_counter(), None
        self.parts["run"]["order"].append(name)
        if skip or start > self.deadline:
            self.parts[name] = {"skipped": skip or "out of time (--budget-s)"}
        else:
            try:
                result = fn()
                self.parts[name] = result
            except Exception:  # noqa: BLE001 - a failing part is reported, the others still run
                self.parts[name] = {"error": traceback.format_exc()[-3000:]}
            gc.collect()  # an AsyncEngine and its engine refer to each other: their KV pools go back now
            if on_cuda(self.device):
                torch.cuda.empty_cache()
            self.parts["seconds"][name] = round(time.perf_counter() - start, 1)
        self.write()
        print(name, json.dumps(self.parts[name], default=str)[:1500], flush=True)
        return result

    def write(self) -> None:
        self.path.write_text(json.dumps(self.parts, indent=2, default=str))


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"parts that would start later are skipped (default {BUDGET_S:.0f}, --quick {QUICK_BUDGET_S:.0f})",
    )
    parser.add_argument(
        "--quick", action="store_true", help="under 2 minutes: versions, kernels, correctness, one request timed"
    )
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of every part (CUDA's kernels skipped)")
    parser.add_argument("--preset", default="qwen3-1.7b", help="the decoder of parts 3-8 (tiny for a dry run)")
    parser.add_argument("--contexts", default="1000,5000", help="SID-GR's contexts, tokens (a dry run: 64,128)")
    return parser.parse_args(argv)


def steps(args: argparse.Namespace, report: Report, big: dict[str, Engine]):
    """The run in the module docstring's order: (name, fn, skip) for a part (`skip`: a reason not to run it), or
    (name, fn, "note") for what goes under "run". Lazy: a step is made after the one before it ran, so it sees which
    of the preset's engines started (`big`)."""
    device, contexts, quick = args.device, [int(n) for n in args.contexts.split(",")], args.quick
    cuda = on_cuda(device)
    yield "versions", versions, None
    yield "kernels", lambda: varlen_checks(device), None if cuda else "no CUDA"
    yield "attention choice", lambda: attention_choice(device, args.preset), None if cuda else "no CUDA"

    # The preset's engines first, each started before any other model compiles.
    names, overrides = (QUICK_ENGINES, QUICK_OPTIONS) if quick else (tuple(ENGINE_OPTIONS), None)
    yield f"load {args.preset}", lambda: loaded(big, device, args.preset, names, overrides), None
    missing = None if set(QUICK_ENGINES) <= set(big) else "the preset's engines did not start"
    if not quick:  # the profiles, before any timing: they explain it
        yield from profile_steps(big, contexts, device, missing)
    yield f"judged {args.preset} 256/3", lambda: big_judged(big, contexts), missing
    for context in contexts:
        yield (
            f"sid-gr {context}/256/3",
            lambda n=context: sid_gr_timed(big, n, device, report.repeats(3 if quick else 5), full=not quick),
            missing,
        )
    if not quick:  # on the fast engine alone (the others freed first: its own engine starts a pool of its own)
        others = f"released {args.preset} but fast"
        yield (
            others,
            lambda: release({name: big.pop(name) for name in list(big) if name != "fast"}, device, False),
            "note",
        )
        yield "load pattern (fast)", lambda: load_pattern(big["fast"], device, 6.0 if cuda else 1.0), missing
        shape = WIDE_CALLERS if cuda else WIDE_CALLERS_DRY
        yield (
            "{callers} callers of beam {beam} at {context} (fast)".format(**shape),
            lambda: wide_callers(big["fast"], device, **shape),
            missing,
        )
    yield f"released {args.preset}", lambda: release(big, device), "note"

    # Then the other models, Dynamo's caches reset after each.
    for architecture in ("qwen3", "qwen2"):
        yield f"judged tiny {architecture}", lambda a=architecture: tiny_judged(device, a), None
        yield f"released tiny {architecture}", lambda: release({}, device), "note"
    if not quick:
        events, candidates = (2000, 500) if cuda else (200, 50)
        yield f"hstu {events}/{candidates}", lambda: hstu(device, events, candidates, report.repeats(5)), None


def profile_steps(big: dict[str, Engine], contexts: list[int], device, missing: str | None):
    """The profile parts (`steps`): launches per decode pass; where one request's time goes at each context, fast
    and split-KV off; then a batch of 8's and 4 callers' at the longest context (their gaps to SID-GR)."""
    n = 2000 if on_cuda(device) else contexts[-1]
    yield f"launches per decode pass 4 x {n}/30", lambda: launches_per_decode_pass(big, n, [30] * 4, device), missing
    for name, label in (("fast", ""), ("fast_whole", " split-KV off")):
        for context in contexts:
            yield (
                f"where the time goes {context}/256/3{label}",
                lambda n=context, e=name: where_time_goes(big[e], n, device),
                missing or (None if name in big else f"{name} did not start"),
            )
    for workload in WORKLOADS[1:]:
        yield (
            f"where the time goes {contexts[-1]}/256/3 {workload}",
            lambda w=workload: where_time_goes(big["fast"], contexts[-1], device, w),
            missing,
        )


def main(argv: list[str] | None = None) -> dict:
    """The steps; returns the report (also written to --out)."""
    args = arguments(argv)
    budget_s = args.budget_s if args.budget_s is not None else QUICK_BUDGET_S if args.quick else BUDGET_S
    report = Report(args.out, budget_s, args.device)
    report.note("args", {name: str(value) for name, value in vars(args).items()})
    report.note("compile", compile_headroom())  # before anything compiles
    for name, fn, skip in steps(args, report, {}):
        if skip == "note":
            try:
                report.note(name, fn())
            except Exception:  # noqa: BLE001 - recorded; the parts after it still run
                report.note(name, {"error": traceback.format_exc()[-3000:]})
        else:
            report.part(name, fn, skip)
    report.note("total_s", round(budget_s - report.left(), 1))
    return report.parts


def gpu_consistency(device: str) -> dict:
    """The same tiny model in float32 on CPU and on the device: same beams, same scores."""
    model_dir = write_model_dir(Path(tempfile.mkdtemp()) / "m", ModelSpec(items=300, levels=3, codebook=8))
    cpu = Engine.from_pretrained(model_dir, device="cpu", dtype=torch.float32)
    dev = Engine.from_pretrained(model_dir, device=device, dtype=torch.float32)
    retrieve = [RetrieveRequest(prompt_token_ids=list(range(5, 5 + n)), beam_width=w) for n, w in ((40, 300), (7, 5))]
    score = [ScoreRequest(prompt="user liked", candidates=[Candidate(item_id=i) for i in cpu.catalog.item_ids[:50]])]
    same, beams, scores = agreement(cpu, dev, retrieve, score)
    return {"same_items": all(same), "max_logprob_diff": beams, "max_score_diff": scores}


def suite_runs(device: str, preset_name: str):
    from genrec_bench import engine, load

    yield "consistency", lambda: gpu_consistency(device)
    shape = dict(preset=preset_name, device=device, prompt_len=2000, beam_width=30, levels=5)
    for running in (64, 16, 8):
        options = LoadOptions(rates="8,16,24,32", duration=6.0, candidates=100, burst=64, max_running=running, **shape)
        yield f"load-2000-30-5-running{running}", lambda o=options: load.run(o)
    yield "retrieve-2000-30-5", lambda: engine.retrieve(RetrieveOptions(**shape, repeats=5, user_embedding=True))
    wide = {**shape, "prompt_len": 1000, "beam_width": 256, "levels": 3}
    yield "retrieve-1000-256-3", lambda: engine.retrieve(RetrieveOptions(**wide, repeats=5))
    score = ScoreOptions(
        prefix_len=1000, candidates=500, preset=preset_name, device=device, repeats=5, fanout_sample=50
    )
    yield "score-1000-500", lambda: engine.score(score)
    batch8 = RetrieveOptions(**shape, batch=8, repeats=3, hf_baseline=False)
    yield "retrieve-batch8-2000-30-5", lambda: engine.retrieve(batch8)


def run_suite(o: SuiteOptions) -> dict:
    o.out.mkdir(parents=True, exist_ok=True)
    only = o.only.split(",") if o.only else None
    summary = {}
    for name, fn in suite_runs(o.device, o.preset):
        if only and name not in only:
            continue
        start = time.perf_counter()
        try:
            report = fn()
            status = "ok"
        except Exception as err:  # noqa: BLE001 - recorded, the suite goes on
            report = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            status = "error"
        report["wall_seconds"] = time.perf_counter() - start
        (o.out / f"{name}.json").write_text(json.dumps(report, indent=2))
        summary[name] = {"status": status, "ratios": report.get("ratios"), "wall_seconds": report["wall_seconds"]}
        print(json.dumps({name: summary[name]}), flush=True)
    return summary


if __name__ == "__main__":
    main()
