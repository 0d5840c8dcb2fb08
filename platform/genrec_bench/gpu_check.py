"""The prepared check for a GPU session (issue 38): one command, under 5 minutes on one H200, without Ray.

    PYTHONPATH=platform python -m genrec_bench.gpu_check --out gpu_check.json --budget-s 280 [--quick]

Parts, in order; each part's JSON is written as it finishes, a failing part records its error and the others go
on, and a part that would start after `--budget-s` is skipped:
1. versions, and the schema of the FlashAttention-2 varlen aten op (seqused_k present?);
2. kernels: the CUDA varlen path against the plain-torch float32 reference (decode-like spans with gaps, a sequence
   without keys, GQA; causal prefill-like spans), bf16 and fp16, and the float32 reference on CUDA against the CPU;
3. correctness of the fast path and of eager, each judged on its own against float32 (`judge`, below): the tiny
   preset (qwen3, qwen2), then Qwen3-1.7B dimensions at SID-GR's shape (beam 256, 3 levels, contexts 1,000 and
   5,000);
4. SID-GR's shapes timed in-process from submission to result, prompt tokens given (Qwen3-1.7B dimensions, bf16,
   random weights, prefix cache off; beam 256 / 3 levels at contexts 1,000 and 5,000): one request, a batch of 8,
   4 concurrent callers (threads over an AsyncEngine), fast (`cuda_fast=True`) beside eager (`cuda_fast=False`) and
   one plain prefill of the same prompts; one request also fast with split-KV off (`fast_whole`); one request and
   the batch also on a fast engine whose decode graphs select the beams themselves (`fast_selecting`, a sort in
   the graph, `cuda_graph_selection`), with its beams beside the fast engine's (`selecting_beside_fast`), and judged in
   part 3 as the others are;
5. HSTU (tiny preset) at 2,000 events / 500 candidates: `genrec bench rank` in-process, and a returning user cold,
   warm under the cost rule and warm reading every cached piece, at 2,000 and 4,000 events;
6. `bench load --cuda-fast`'s pattern in-process: a thread making prompts (reading the trie on the device) and
   submitting requests of many widths while the engine loop captures and replays decode graphs; its errors;
7. launches per decode pass and its selection (torch.profiler): eager, FA2 varlen, replayed as a CUDA graph, and
   replayed by the graphs that select;
8. where one request's time goes at 1000/256/3 and 5000/256/3 (torch.profiler, the fast engine): wall time, GPU busy
   time and idle gaps, kernel time by kind (matrix products, attention, selection, copies, compiled pieces, other)
   and the kernels that took longest.

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


KV_BUDGET = 8 << 30  # bytes of KV pool per engine: 8 contexts of 5,000 tokens and their beams fit (bf16)
COLD = SchedulerConfig(prefix_cache_bytes=0, kv_budget_bytes=KV_BUDGET)  # the prefix cache off: rounds repeat
SID_GR_WIDTH, SID_GR_LEVELS = 256, 3  # SID-GR's headline shape: beam 256, 3 tokens, contexts 1,000 and 5,000

# -- 3: correctness, judged against float32 ----------------------------------------------------------------------

NOISE_SHARE = 1 / 32  # ν = NOISE_SHARE * |t_k|, at least NOISE_FLOOR (the module's docstring says why)
NOISE_FLOOR = 1 / 16


def judge(returned: list[tuple[str, float]], exact: dict[str, float], kth_best: float) -> dict:
    """The rule (module docstring): `returned` (item, its own log-probability) by the engine judged, `exact` those
    items' float32 log-probabilities (restricted, exhaustive), `kth_best` the float32 beam search's k-th best."""
    noise = max(abs(kth_best) * NOISE_SHARE, NOISE_FLOOR)
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
        verdict = judge(returned, exact_logprobs(reference, request, [item for item, _ in returned]), kth_best)
        verdict["overlap_with_float32"] = len(best & {item for item, _ in returned}) / max(len(best), 1)
        out[name] = verdict
    out["ok"] = all(out[name]["ok"] for name in engines)
    return out


def tiny_judged(device, architecture: str = "qwen3") -> dict:
    """The tiny preset (3 levels) of the decoder architecture, bf16, fast and eager, judged against float32."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / "tiny", preset("tiny", architecture=architecture, levels=3))
        bf16 = {"device": device, "dtype": torch.bfloat16, "scheduler": COLD}
        engines = {
            "fast": Engine.from_pretrained(model_dir, cuda_fast=True, **bf16),
            "eager": Engine.from_pretrained(model_dir, cuda_fast=False, **bf16),
        }
        reference = Engine.from_pretrained(model_dir, device=device, dtype=torch.float32, scheduler=COLD)
        g = torch.Generator().manual_seed(3)
        out = {
            f"{n}/{w}": judged(
                engines, reference, RetrieveRequest(prompt_token_ids=random_prompt(reference, n, g), beam_width=w)
            )
            for n, w in ((200, 30), (57, 256), (1000, 100))
        }
        out["ok"] = all(part["ok"] for part in out.values())
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


# -- 4: SID-GR's shapes, timed -----------------------------------------------------------------------------------


def big_engines(device, preset_name: str) -> dict[str, Engine]:
    """The preset's dimensions (Qwen3-1.7B's), random weights: bf16 with the fast path on and off (passed
    explicitly, whatever the default), the fast path selecting inside its decode graphs (`cuda_graph_selection`), and
    the float32 reference the correctness rule re-scores with."""
    model_dir = model_dir_for(preset_name, None, SID_GR_LEVELS)
    bf16 = {"device": device, "dtype": torch.bfloat16, "scheduler": COLD}
    selecting = Engine.from_pretrained(model_dir, cuda_fast=True, cuda_graph_selection=True, **bf16)
    return {
        "fast": Engine.from_pretrained(model_dir, cuda_fast=True, **bf16),
        "eager": Engine.from_pretrained(model_dir, cuda_fast=False, **bf16),
        "float32": Engine.from_pretrained(
            model_dir, device=device, dtype=torch.float32, cuda_fast=False, scheduler=COLD
        ),
        "fast_selecting": selecting,  # started last (`loaded`): a capture it cannot make costs the others nothing
    }


def sid_gr_requests(engine: Engine, context: int, count: int = 8) -> list[RetrieveRequest]:
    g = torch.Generator().manual_seed(context)
    width = SID_GR_WIDTH
    return [RetrieveRequest(prompt_token_ids=random_prompt(engine, context, g), beam_width=width) for _ in range(count)]


def big_judged(big: dict[str, Engine], contexts: list[int]) -> dict:
    """SID-GR's shape: one request per context, fast and eager (and the fast engine that selects inside its graphs,
    where it started) each judged against float32."""
    arms = {name: big[name] for name in ("fast", "eager", "fast_selecting") if name in big}
    out = {str(n): judged(arms, big["float32"], sid_gr_requests(big["fast"], n, 1)[0]) for n in contexts}
    out["ok"] = all(part["ok"] for part in out.values())
    return out


def sid_gr_timed(big: dict[str, Engine], context: int, device) -> dict:
    """One request and a batch of 8, fast beside eager and beside one plain prefill of the same prompts (the floor),
    and beside the fast engine that selects inside its graphs where it started; then 4 concurrent callers, fast
    beside eager. Seconds are medians, from submission to result."""
    fast, eager = big["fast"], big["eager"]
    selecting = big.get("fast_selecting")
    also = {"fast_selecting": selecting} if selecting else {}
    requests = sid_gr_requests(fast, context)
    prepared = [fast.prepare(r) for r in requests]
    one = interleaved_medians(
        {
            "fast": lambda: fast.retrieve(requests[:1]),
            "fast_whole": lambda: unsplit(fast, lambda: fast.retrieve(requests[:1])),
            **{name: lambda e=e: e.retrieve(requests[:1]) for name, e in also.items()},
            "eager": lambda: eager.retrieve(requests[:1]),
            "one_prefill": lambda: fast.runner.prefill_alone(prepared[0]),
        },
        5,
        device,
    )
    batch = interleaved_medians(
        {
            "fast": lambda: fast.retrieve(requests),
            **{name: lambda e=e: e.retrieve(requests) for name, e in also.items()},
            "eager": lambda: eager.retrieve(requests),
            "one_prefill_each": lambda: [fast.runner.prefill_alone(p) for p in prepared],
        },
        3,
        device,
    )
    concurrent = {name: callers_rate(big[name], requests) for name in ("fast", "eager")}
    ratios = {
        "one_fast_over_prefill": one["fast"] / one["one_prefill"],
        "one_whole_over_split": one["fast_whole"] / one["fast"],
        "one_eager_over_fast": one["eager"] / one["fast"],
        "batch_fast_over_prefills": batch["fast"] / batch["one_prefill_each"],
        "batch_eager_over_fast": batch["eager"] / batch["fast"],
        "concurrent_fast_over_eager_rate": concurrent["fast"]["requests_per_s"] / concurrent["eager"]["requests_per_s"],
    }
    report = {"one_request_s": one, "batch_8_s": batch, "concurrent_4": concurrent, "ratios": ratios}
    if selecting:
        report["selecting_beside_fast"] = same_beams(fast, selecting, requests)
        ratios["one_selecting_over_fast"] = one["fast_selecting"] / one["fast"]
        ratios["batch_selecting_over_fast"] = batch["fast_selecting"] / batch["fast"]
    return report


def same_beams(a: Engine, b: Engine, requests: list[RetrieveRequest]) -> dict:
    """Two engines of the same kernels and dtype (the eager selection and the one inside the graph) on the same
    requests: how many return the same items, and the largest logprob difference. Information, not a verdict: where
    candidates tie exactly at a level's cut (bf16 logits often do), each keeps another of them and both are right
    (the verdict is part 3's rule, against float32)."""
    same, beams = beams_agree(a, b, requests)
    return {"same_items": sum(same), "of": len(same), "max_logprob_diff": beams}


def unsplit(engine: Engine, fn):
    """fn() with split-KV off: every one-span context read whole (the plan's `split_kv`)."""
    plan = engine.runner.plan
    engine.runner.plan = dataclasses.replace(plan, split_kv="off")
    try:
        return fn()
    finally:
        engine.runner.plan = plan


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


# -- 5: HSTU -----------------------------------------------------------------------------------------------------


def hstu(device) -> dict:
    """`genrec bench rank` at 2,000 events / 500 candidates on the device (its plain-forward baseline included), and
    a returning user (10 events more per visit) cold, warm under the cost rule, and warm reading every piece."""
    from genrec_bench import engine as benches

    out = {"bench_rank": benches.rank(RankOptions(device=device, repeats=5, fanout_sample=5))}
    ranker = Engine.from_pretrained(hstu_preset_dir("tiny"), device=device, scheduler=COLD)
    for events in (2000, 4000):
        request = benches.rank_request(ranker, events, 500)
        out[f"returning {events}/500"] = benches.warm_and_cold(ranker, request, 10, 5, device, every_piece=True)
    return out


# -- 6: bench load's pattern -------------------------------------------------------------------------------------


def load_pattern(engine: Engine, seconds: float = 6.0, timeout_s: float = 90.0) -> dict:
    """`bench load --cuda-fast`'s pattern in-process: this thread makes prompts (reading the trie on the device, as
    its request maker does) and submits requests of many beam widths, while the engine loop captures (or replays)
    a decode graph for each new row bucket: a fresh runner over the engine's weights (`bench load`'s `serving`), so
    that no bucket was captured before. Records every request's error."""
    from genrec_bench.load import serving

    widths, g = (1, 3, 8, 30, 64, 100, 256, 17), torch.Generator().manual_seed(7)
    futures, errors = [], []
    with serving(engine, prefix_cache_bytes=0, kv_budget_bytes=KV_BUDGET) as (async_engine, _):
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
    return {"submitted": len(futures), "errors": len(errors), "first_errors": errors[:3], "ok": not errors}


# -- 7: launches per decode pass ---------------------------------------------------------------------------------


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


def launch_counts(prof) -> dict:
    """A profile's device kernels, kernel launch calls and CUDA graph launches."""
    names = [e.name for e in prof.events()]
    return {
        "kernels": len(device_kernels(prof)),
        "launch_calls": sum(n in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC") for n in names),
        "graph_launches": names.count("cudaGraphLaunch"),
    }


def launches_per_decode_pass(engines: dict[str, Engine], prompt_len: int, beams: list[int]) -> dict:
    """Kernels and launch calls of one decode pass and its selection (torch.profiler): the `eager` engine; the `fast`
    one eagerly (FA2 varlen); the static pass replayed as a CUDA graph; and replayed by the engine whose graphs
    select (where it started). Also each against eager (logprobs, items)."""
    from torch.profiler import ProfilerActivity, profile

    from genrec.engine.beam import fetch_finals

    out, finals = {}, {}
    modes = {"eager": "eager", "varlen": "fast", "graphs": "fast", "graphs_selecting": "fast_selecting"}
    for mode in [m for m, name in modes.items() if name in engines]:
        engine = engines[modes[mode]]
        cohorts, bucketed = _cohorts(engine, prompt_len, beams), mode.startswith("graphs")
        engine.runner.decode(cohorts, bucketed)  # warm-up (graphs were captured at the engine's start)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            engine.runner.decode(cohorts, bucketed)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        while not all(c.done for c in cohorts):
            engine.runner.decode([c for c in cohorts if not c.done], bucketed)
        finals[mode] = fetch_finals(cohorts)
        out[mode] = {**launch_counts(prof), "seconds": seconds}
    for mode in [m for m in finals if m != "eager"]:
        same = [a[1] == b[1] for a, b in zip(finals["eager"], finals[mode], strict=True)]
        diff = max(
            max(abs(x - y) for x, y in zip(a[0], b[0], strict=True))
            for a, b in zip(finals["eager"], finals[mode], strict=True)
        )
        out[f"{mode}_items_equal_eager"], out[f"{mode}_max_score_diff"] = same, diff
    return out


# Kernel kinds by name, first match wins (cuBLAS / CUTLASS products, FlashAttention, the beam selection's sorts and
# gathers, copies and casts, Inductor's compiled pieces).
KERNEL_KINDS = (
    ("attention", ("flash", "fmha")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "splitk")),
    ("selection", ("topk", "sort", "radix", "scan", "gather", "index", "softmax", "logsumexp")),
    ("copy", ("copy", "memcpy", "memset", "fill", "cat")),
    ("compiled", ("triton",)),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, words in KERNEL_KINDS if any(w in lowered for w in words)), "other")


def where_time_goes(engine: Engine, context: int, device) -> dict:
    """One request at `context`/256/3 under torch.profiler, after a warm-up: wall time, the GPU's busy time (the
    union of its kernels' intervals) and idle gaps, kernel time by kind, and the ten kernels that took longest."""
    from torch.profiler import ProfilerActivity, profile

    (request,) = sid_gr_requests(engine, context, count=1)
    engine.retrieve([request])
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        engine.retrieve([request])
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
        "wall_ms": wall_ms,
        "gpu_busy_ms": busy_us / 1e3,
        "gpu_idle_ms": wall_ms - busy_us / 1e3,
        **launch_counts(prof),
        "kernel_ms_by_kind": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "longest_kernels_ms": {k: round(v, 3) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:10]},
    }


# -- the run -----------------------------------------------------------------------------------------------------


class Report:
    """The parts' results, rewritten to `path` after each part; a part records its error instead of raising, and
    one that would start after the deadline is skipped."""

    def __init__(self, path: Path, budget_s: float):
        self.path, self.deadline, self.parts = path, time.perf_counter() + budget_s, {}
        path.parent.mkdir(parents=True, exist_ok=True)

    def part(self, name: str, fn):
        start, result = time.perf_counter(), None
        if start > self.deadline:
            self.parts[name] = {"skipped": "out of time (--budget-s)"}
        else:
            try:
                result = fn()
                self.parts[name] = result
            except Exception:  # noqa: BLE001 - a failing part is reported, the others still run
                self.parts[name] = {"error": traceback.format_exc()[-3000:]}
            gc.collect()  # an AsyncEngine and its engine refer to each other: their KV pools go back now
            self.parts.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 1)
        self.path.write_text(json.dumps(self.parts, indent=2, default=str))
        print(name, json.dumps(self.parts[name], default=str)[:1500], flush=True)
        return result


def loaded(big: dict, device, preset_name: str) -> dict:
    """The engines, each started (its captures and warm-up requests: `start_s`, `warmup_s`), then the fast one's
    first request at 1000/256/3 beside its second: nothing should compile or capture on the first."""
    big.update(big_engines(device, preset_name))
    memory = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    started = {}
    for name, engine in list(big.items()):
        start = time.perf_counter()
        try:
            assert engine.scheduler.idle
        except Exception as err:  # noqa: BLE001 - an engine that cannot start is reported and left out
            if name in ("fast", "eager", "float32"):
                raise
            started[name] = {"error": f"{type(err).__name__}: {err}"}
            del big[name]
            continue
        started[name] = {"start_s": time.perf_counter() - start, "warmup_s": engine.runner.warmup_s}
    (request,) = sid_gr_requests(big["fast"], 1000, count=1)
    first, second = (timed(lambda: big["fast"].retrieve([request]), device) for _ in range(2))
    return {
        "engines": sorted(big),
        "gpu_memory_gib": round(memory / 2**30, 1),
        "started": started,
        "fast_first_request_s": first,
        "fast_second_request_s": second,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--budget-s", type=float, default=280.0, help="parts that would start later are skipped")
    parser.add_argument("--quick", action="store_true", help="versions, kernels and correctness only")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script's parts (kernels fail)")
    parser.add_argument("--preset", default="qwen3-1.7b", help="the decoder of parts 3-7 (tiny for a dry run)")
    parser.add_argument("--contexts", default="1000,5000", help="SID-GR's contexts, tokens")
    args = parser.parse_args()
    device, report = args.device, Report(args.out, args.budget_s)
    contexts = [int(n) for n in args.contexts.split(",")]
    report.part("versions", versions)
    report.part("kernels", lambda: varlen_checks(device))
    for architecture in ("qwen3", "qwen2"):
        report.part(f"judged tiny {architecture}", lambda a=architecture: tiny_judged(device, a))
    big: dict[str, Engine] = {}
    report.part(f"load {args.preset}", lambda: loaded(big, device, args.preset))
    if not big:
        return
    report.part(f"judged {args.preset} 256/3", lambda: big_judged(big, contexts))
    if args.quick:
        return
    for context in contexts:
        report.part(f"sid-gr {context}/256/3", lambda n=context: sid_gr_timed(big, n, device))
    report.part("hstu 2000/500", lambda: hstu(device))
    report.part("load pattern (fast)", lambda: load_pattern(big["fast"]))
    report.part("launches per decode pass 4 x 2000/30", lambda: launches_per_decode_pass(big, 2000, [30] * 4))
    for context in contexts:
        report.part(f"where the time goes {context}/256/3", lambda n=context: where_time_goes(big["fast"], n, device))


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
