"""`genrec bench ...`: each benchmark's options, declared once; its typer command is built from them.

A benchmark is an options dataclass and a `run(options) -> dict` (`genrec_bench.<module>.<function>`); the command
prints that JSON (and writes it with --json). The declarations stay here, free of torch, so `genrec` starts fast.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import typing
from pathlib import Path
from typing import Literal

import typer

bench_app = typer.Typer(
    name="bench",
    help="Benchmarks: each prints JSON with ratios against a baseline of the same run.",
    no_args_is_help=True,
)
CUDA_FAST = "CUDA: FA2 varlen + decode graphs captured at start (default: on with CUDA)"
BLOCK_TOKENS = 16  # a prefix-cache block (genrec.engine.prefix_cache.BLOCK; this module stays free of torch)
PEER = "vllm: also run vLLM on the same model and prompts (`make peers`)"


def opt(default, help: str | None = None, *flags: str, **checks):
    """One option: its default, help, flags (default: --field-name) and typer's checks (min=, max=, callback=)."""
    return dataclasses.field(default=default, metadata={"option": typer.Option(default, *flags, help=help, **checks)})


def device_opt(default: str = "cpu"):
    """--device, checked against this machine before any model is built."""
    return opt(default, callback=_device)


def _device(device: str) -> str:
    from genrec_bench.common import check_device

    return check_device(device)


PRESETS = "tiny | small | qwen3-1.7b (random weights)"


@dataclasses.dataclass
class Preset:
    """The options every benchmark of a model shares, in parts (a command's options derive from those it takes)."""

    preset: str = opt("tiny", PRESETS)


@dataclasses.dataclass
class ModelChoice(Preset):
    """A preset's random-weight directory (cached), or --model."""

    model: Path | None = opt(None, "a model directory instead of a preset")


@dataclasses.dataclass
class PresetLevels(ModelChoice):
    levels: int | None = opt(None, "code length of the preset's catalog (3-5)", min=1)


@dataclasses.dataclass
class OnDevice:
    device: str = device_opt()


@dataclasses.dataclass
class CudaFast:
    cuda_fast: bool | None = opt(None, CUDA_FAST, "--cuda-fast/--no-cuda-fast")


@dataclasses.dataclass
class LargeCatalog(Preset, OnDevice):
    """A random catalog of OpenOneRec's shape (1 M items, 3 levels of 8,192 codes) on a preset's dimensions."""

    items: int = opt(1_000_000, "catalog items", min=1)
    per_level: int = opt(8192, "codes per level (the model's vocabulary has as many)", min=2)
    levels: int = opt(3, min=1)
    beam_width: int = opt(256, min=1)
    prompt_len: int = opt(1000, min=1)


SHARED = ("preset", "model", "levels", "device", "cuda_fast")


def bench(name: str, target: str, json_out: bool = True):
    """Declares an options class as the command `genrec bench NAME`, which runs `genrec_bench.TARGET(options)`."""

    def declare(cls):
        cls, hints, kw = dataclasses.dataclass(cls), typing.get_type_hints(cls), inspect.Parameter.KEYWORD_ONLY
        shared = list(SHARED)  # --help: the command's own options, then the shared parts' in one order
        ordered = sorted(dataclasses.fields(cls), key=lambda f: shared.index(f.name) + 1 if f.name in shared else 0)
        fields = [(f.name, f.metadata["option"], hints[f.name]) for f in ordered]
        if json_out:
            fields.append(("json_out", typer.Option(None, "--json", help="also write the JSON here"), Path))

        def command(**values):
            out = values.pop("json_out", None)
            module, function = target.rsplit(".", 1)  # looked up at each call (tests replace it)
            report = getattr(importlib.import_module(f"genrec_bench.{module}"), function)(cls(**values))
            text = json.dumps(report, indent=2)
            typer.echo(text)
            if out:
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(text)

        command.__signature__ = inspect.Signature(
            [inspect.Parameter(n, kw, default=d, annotation=t) for n, d, t in fields]
        )
        command.__annotations__ = {n: t for n, _, t in fields}
        command.__doc__ = cls.__doc__
        bench_app.command(name)(command)
        return cls

    return declare


@bench("retrieve", "engine.retrieve")
class RetrieveOptions(PresetLevels, OnDevice, CudaFast):
    """Engine.retrieve against one plain prefill (the floor) and transformers beam search."""

    prompt_len: int = opt(2000, min=1)
    beam_width: int = opt(30, min=1)
    batch: int = opt(1, "requests per Engine.retrieve call", min=1)
    repeats: int = opt(3, min=1)
    hf_baseline: bool = opt(True, "also time transformers generate(num_beams=...)")
    user_embedding: bool = opt(False, "also time the soft-token path against token-only prompts")
    prefix_cache: bool = opt(
        False, "also time a cache miss: the same prompts on an engine with the prefix cache on, each a new user's"
    )
    peer: str | None = opt(None, PEER)
    beam_widths: str | None = opt(
        None,
        "also time this per-level schedule, one width per code level ending with --beam-width (e.g. 32,128,256 with "
        "--beam-width 256), against --beam-width at every level, on the same prompts",
    )


@bench("kernels", "kernels.run")
class KernelsOptions(ModelChoice, OnDevice):
    """Kernels per prefill layer and per decode-pass layer (CUDA: profiled kernels; CPU: aten ops that compute), the
    fused path (--cuda-fast's pieces) against the unfused one."""

    prompt_len: int = opt(1000, "prefill tokens; each decode request's context", min=1)
    requests: int = opt(4, "requests in the decode pass", min=1)
    beam_width: int = opt(30, "rows per request in the decode pass", min=1)
    hstu_preset: str | None = opt(
        "tiny", "also an HSTU preset's layers: --prompt-len events, requests x beam width candidates"
    )


@bench("sid-catalog", "sid_catalog.run")
class SidCatalogOptions(LargeCatalog, CudaFast):
    """A large SID catalog (OpenOneRec's 3 x 8,192 levels, 1 M items): its trie's build time, and beam search over it
    against the same model over a catalog of 256 codes per level (same items, same prompts, round-robin)."""

    small_per_level: int = opt(256, "codes per level of the baseline catalog", min=2)
    batch: int = opt(1, "requests per Engine.retrieve call", min=1)
    repeats: int = opt(5, min=1)
    build_repeats: int = opt(3, "trie builds timed", min=1)


@bench("filter", "filters.run")
class FilterOptions(LargeCatalog):
    """A per-request filter (10 % of a 1 M-item catalog by default) in a beam search over it: its mask compiled in the
    request (a new filter) and cached, against the same retrieve unfiltered (same prompts, round-robin)."""

    genres: int = opt(10, "of the catalog's 100 genres, the filter allows this many (10: 10 % of the items)", min=1)
    batch: int = opt(1, "requests per Engine.retrieve call", min=1)
    repeats: int = opt(7, "rounds timed (each cold round a filter not seen before)", min=1, max=90)


@bench("score", "engine.score")
class ScoreOptions(ModelChoice, OnDevice, CudaFast):
    """One-pass scoring against one forward per candidate and one plain forward of as many tokens."""

    prefix_len: int = opt(1000, min=1)
    candidates: int = opt(500, min=1)
    candidate_len: int = opt(0, "random candidates of this many tokens (0: catalog items' codes)", min=0)
    repeats: int = opt(3, min=1)
    fanout_sample: int = opt(50, "fan-out forwards actually timed (the rest are the same cost)", min=1)
    peer: str | None = opt(None, PEER)


@bench("load", "load.run")
class LoadOptions(PresetLevels, OnDevice, CudaFast):
    """Open-loop Poisson load on the in-process AsyncEngine, with sequential and saturation baselines."""

    kind: Literal["retrieve", "score", "mixed"] = opt("retrieve")
    rates: str = opt("1,2,4", "offered loads, requests per second")
    duration: float = opt(10.0, "seconds of arrivals per rate", min=0.1)
    prompt_len: int = opt(2000, min=1)
    beam_width: int = opt(30, min=1)
    candidates: int = opt(100, "candidates per score request", min=1)
    burst: int = opt(64, "requests sent at once to measure saturation throughput", min=1)
    max_running: int | None = opt(None, "requests the engine runs at once (default: 8 on CUDA, 64 on CPU)", min=1)
    threads: int | None = opt(None, "torch threads (default: torch's, one per core)", min=1)
    pin: bool = opt(False, "bind the threads to --threads cores (Linux; needs --threads)", "--pin")
    plot: Path | None = opt(None, "PNG: latency against offered load")


@bench("threads", "load.threads")
class ThreadsOptions(ModelChoice):
    """Engine thread settings on a contended machine: one thread and one per core, pinned (genrec.threads) and
    unpinned, each `bench load` in its own process while busy processes load every core."""

    background: int | None = opt(None, "busy processes kept running (default: one per core)", min=0)
    rounds: int = opt(3, "runs of every setting, in alternating order", min=1)
    rate: float = opt(2.0, "offered load of each run's latency point, requests per second")
    duration: float = opt(8.0, "seconds of arrivals per run", min=0.1)
    burst: int = opt(16, "requests sent at once for each run's saturation throughput", min=1)
    settle_s: float = opt(60.0, "seconds of background load before the first run", min=0.0)
    prompt_len: int = opt(2000, min=1)
    beam_width: int = opt(30, min=1)


@bench("returning", "returning.run")
class ReturningOptions(ModelChoice, OnDevice, CudaFast):
    """Returning users (previous prompt + new events): prefix cache off vs on, and the two prompt layouts; with
    --serve, the reuse rate through Serve routed by user against Serve's default router."""

    preset: str | None = opt(
        None, "a preset with a soft-token projector (default: realistic, hidden 512; tiny with --serve)"
    )
    events: int | None = opt(
        None, "history events in a prompt, x levels tokens (default: 400, 2000 tokens; 200 with --serve)", min=2
    )
    new_events: int = opt(2, "events a returning user adds per request", "--new-events", min=1)
    users: int | None = opt(None, "returning users, Zipf popularity (default: 16; 8 with --serve)", min=1)
    new_user_share: float = opt(0.2, "requests from first-time users", min=0.0, max=1.0)
    burst: int = opt(24, "requests sent at once for the saturation figure", min=1)
    rate: float = opt(0.5, "offered load for the p50/p99 figures, requests per second")
    duration: float = opt(20.0, min=0.1)
    repeats: int = opt(5, "returning requests timed for the single-user figure", min=1)
    serve: bool = opt(
        False,
        "instead: through a local Serve app with 2 engine replicas (CPU), reuse rate with genrec's user router and "
        "with Serve's default router against one replica",
        "--serve",
    )
    requests: int = opt(40, "--serve: requests after the users' first visits", min=1)
    concurrency: int = opt(2, "--serve: requests in flight (one per user at a time)", min=1)


@bench("rank", "engine.rank")
class RankOptions(ModelChoice, OnDevice):
    """HSTU ranking: one pass vs one request per candidate vs the plain masked forward; warm vs cold history."""

    preset: str = opt("tiny", "HSTU preset (tiny: model dim 256, 4 layers, 4 heads, head dim 64)")
    model: Path | None = opt(None, "an HSTU model directory instead of a preset")
    events: int = opt(2000, "history events", min=1)
    candidates: int = opt(500, min=1)
    repeats: int = opt(3, min=1)
    fanout_sample: int = opt(20, "one-candidate requests actually timed (scaled to all)", min=1)
    new_events: int = opt(10, "events a returning user adds (warm vs cold)", min=1)


@bench("deadline", "deadline.run")
class DeadlineOptions(ModelChoice, OnDevice):
    """A long-candidate score request with a short deadline and a small retrieve behind it (AsyncEngine): when the
    caller is released against its deadline and one pass; seconds per token-equivalent over passes of several shapes."""

    candidates: int = opt(12, "long candidates in the score request", min=1)
    candidate_len: int | None = opt(None, "tokens per candidate (default: the engine's max_candidate_len)", min=1)
    words: int = opt(3000, "the issue's text candidates: words each (refused when over the cap)", min=1)
    deadline_s: float = opt(2.0, "the score request's deadline", min=0.01)
    repeats: int = opt(5, "deadline runs, and timings of each pass shape", min=1)
    threads: int | None = opt(None, "torch threads (default: torch's, one per core)", min=1)
    score_max_tokens: int = opt(16384, "the engine's pass budget, token-equivalents", min=1)
    max_candidate_len: int | None = opt(None, "the engine's cap on one candidate (default: what one pass holds)", min=1)


@bench("isolation", "isolation.run")
class IsolationOptions(Preset, OnDevice):
    """The prefix cache as a timing side channel across users: one-try accuracy of guessing, by wall time, whether
    a prompt (retriever) or history (ranker) was recently served for another user; in the attacker's own scope and
    with none (chance is 0.5), and in the victim's scope (the control)."""

    preset: str = opt("tiny", "the Qwen3 and HSTU presets (tiny: hidden 256, 4 layers)")
    prompt_len: int = opt(1000, "retriever: prompt tokens", min=BLOCK_TOKENS)
    beam_width: int = opt(32, "retriever", min=1)
    events: int = opt(2000, "ranker: history events", min=BLOCK_TOKENS)
    candidates: int = opt(16, "ranker: candidates per request", min=1)
    guesses: int = opt(40, "timed guesses per way of guessing, half of them right", min=4)
    calibration: int = opt(9, "the attacker's cold and warm requests that set its threshold (per way)", min=1)


@bench("funnel", "serve.funnel")
class FunnelOptions:
    """Two-stage /v1/recommend (Qwen3 retrieval, then HSTU ranking) against /v1/retrieve alone, through a local
    Serve app over HTTP: p50/p90 of each and their ratio."""

    model: Path | None = opt(None, "a Qwen3 model directory (default: a tiny one, hidden 64, 2 layers)")
    ranker: Path | None = opt(None, "an HSTU model directory (default: a tiny one, hidden 64, 2 layers)")
    prompt_len: int = opt(150, "prompt tokens", min=1)
    beam_width: int = opt(50, "retrieved items, all ranked", min=1)
    events: int = opt(50, "history events", min=1)
    requests: int = opt(100, "timed requests per route", min=2)
    users: int = opt(20, "distinct prompts and histories, cycled", min=1)
    warmup: int = opt(5, min=0)


@bench("serve", "serve.serve")
class ServeOptions(PresetLevels):
    """Open-loop load through the Serve app over HTTP and on the in-process AsyncEngine, same run."""

    kind: Literal["retrieve", "score", "mixed"] = opt("retrieve")
    rates: str = opt("2,4,8", "offered loads, requests per second")
    duration: float = opt(10.0, "seconds of arrivals per rate", min=0.1)
    preset: str = opt("small", PRESETS)
    prompt_len: int = opt(200, min=1)
    beam_width: int = opt(32, min=1)
    candidates: int = opt(100, "candidates per score request", min=1)
    burst: int = opt(64, "requests sent at once to measure saturation throughput", min=1)
    pairs: int = opt(25, "requests timed one at a time on both paths, back to back, for the latency Serve adds", min=1)
    plot: Path | None = opt(None, "PNG: latency against achieved throughput, both paths")


@bench("soak", "soak.run")
class SoakOptions(ModelChoice):
    """Memory under bursts: RSS of the ingress, engine, proxy and cache processes of a local Serve app after each
    burst of mixed requests (valid, invalid, unknown users, hang-ups); the second half's growth per 1,000
    requests and whether it plateaued. Bounded by --bursts and --max-seconds."""

    preset: str = opt("tiny", "a preset with a soft-token projector (recommend by user_id)")
    bursts: int = opt(40, "bursts sent, one after another", min=2, max=1000)
    burst: int = opt(100, "requests per burst", min=1, max=2000)
    concurrency: int = opt(32, "requests in flight within a burst", min=1, max=512)
    prompt_len: int = opt(48, min=8)
    beam_width: int = opt(8, min=1)
    candidates: int = opt(16, "item candidates per score request", min=1)
    kv_budget_bytes: int = opt(64 << 20, "the engine's KV pool (resident once written)", min=1 << 20)
    prefix_cache_bytes: int = opt(16 << 20, "the prefix cache's share of the pool", min=0)
    request_timeout_s: float = opt(5.0, "the app's deadline (504 past it)", min=0.1)
    settle_s: float = opt(1.0, "wait after each burst before reading RSS", min=0.0)
    max_seconds: float = opt(900.0, "stop sending bursts after this long", min=10.0, max=7200.0)
    plateau_mb_per_1k: float = opt(1.0, "slope under which a process has plateaued", min=0.0)


@bench("cache", "cache.run")
class CacheOptions:
    """Embedding-cache get throughput (in-process, Ray actor, Redis MGET) and eviction-policy hit rates."""

    keys: int = opt(1_000_000, "at least 10: the hit-rate table holds 10 %", min=10)
    dim: int = opt(128, min=1)
    batch: int = opt(1000, min=1)
    zipf: float = opt(1.1, min=0.0)
    batches: int = opt(200, "batches in the Zipf workload", min=1)
    redis_url: str | None = opt(None, "default: start a private redis-server for the run")


@bench("batch", "batch.run")
class BatchOptions(PresetLevels):
    """Users/s of the Ray Data batch job against a plain loop over the in-process Engine; scaling with actors;
    with --ranker, the two-stage funnel's users/s against retrieve alone."""

    users: int = opt(2000, min=1)
    batch_size: int = opt(32, "users per engine call, in the loop and per shard in the job", min=1)
    prompt_len: int = opt(256, min=1)
    beam_width: int = opt(16, min=1)
    actors: str = opt("1,2", "actor counts to run the job with (the first is compared to the loop)")
    threads: int = opt(1, "torch threads of each engine: the loop's and every actor's", min=1)
    ranker: Path | None = opt(None, "an HSTU directory: also the funnel (retrieve -> rank) against retrieve")
    history_len: int = opt(50, "with --ranker: history events per user", min=1)
    rank_actors: int = opt(1, "with --ranker: the funnel's ranking actors", min=1)


@bench("suite", "gpu_check.run_suite", json_out=False)
class SuiteOptions(Preset, OnDevice):
    """The device benchmark runs in priority order (consistency, load, retrieve, score), isolated."""

    out: Path = opt(Path("out/bench"), "one JSON file per run")
    device: str = device_opt("cuda")
    preset: str = opt("qwen3-1.7b")
    only: str | None = opt(None, "comma-separated run names")


@bench("catalog-reload", "catalog_reload.run")
class CatalogReloadOptions(LargeCatalog):
    """A 1 M-item catalog loaded live under closed-loop retrieve load (1 % of its items changed), then rolled back:
    request latencies overlapping each change against a baseline window of the same run."""

    changed: float = opt(0.01, "share of the items retired and replaced by new ones in the second version", min=0)
    clients: int = opt(4, "closed-loop clients, one request each at a time", min=1)
    warmup_s: float = opt(5.0, min=0)
    window_s: float = opt(15.0, "the baseline window, and the load kept after each change", min=1)
