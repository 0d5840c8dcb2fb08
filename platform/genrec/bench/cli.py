"""`genrec bench ...`: each benchmark prints JSON with ratios against a baseline of the same run."""

from __future__ import annotations

import json
from pathlib import Path

import typer

bench_app = typer.Typer(
    help="Benchmarks: each prints JSON with ratios against a baseline of the same run.", no_args_is_help=True
)


def _device(device: str) -> str:
    """Every --device is checked here, before any model is built."""
    from genrec.bench.common import check_device

    return check_device(device)


@bench_app.command("retrieve")
def bench_retrieve(
    prompt_len: int = typer.Option(2000, min=1),
    beam_width: int = typer.Option(30, min=1),
    preset: str = typer.Option("tiny", help="tiny | small | qwen3-1.7b (random weights)"),
    model: Path = typer.Option(None, help="a model directory instead of a preset"),
    levels: int = typer.Option(None, min=1, help="code length of the preset's catalog (3-5)"),
    batch: int = typer.Option(1, min=1, help="requests per Engine.retrieve call"),
    device: str = typer.Option("cpu", callback=_device),
    repeats: int = typer.Option(3, min=1),
    hf_baseline: bool = typer.Option(True, help="also time transformers generate(num_beams=...)"),
    user_embedding: bool = typer.Option(False, help="also time the soft-token path against token-only prompts"),
    peer: str = typer.Option(None, help="vllm: also run vLLM on the same model and prompts (`make peers`)"),
    cuda_fast: bool = typer.Option(False, "--cuda-fast", help="CUDA: FA2 varlen + decode graphs (unverified)"),
    json_out: Path = typer.Option(None, "--json", help="also write the JSON here"),
):
    """Engine.retrieve against one plain prefill (the floor) and transformers beam search."""
    from genrec.bench.retrieve import run

    report = run(
        prompt_len,
        beam_width,
        preset,
        model,
        levels,
        batch,
        device,
        repeats,
        hf_baseline,
        user_embedding,
        peer,
        cuda_fast,
    )
    _emit(report, json_out)


@bench_app.command("score")
def bench_score(
    prefix_len: int = typer.Option(1000, min=1),
    candidates: int = typer.Option(500, min=1),
    candidate_len: int = typer.Option(0, min=0, help="random candidates of this many tokens (0: catalog items' codes)"),
    preset: str = typer.Option("tiny"),
    model: Path = typer.Option(None),
    device: str = typer.Option("cpu", callback=_device),
    repeats: int = typer.Option(3, min=1),
    fanout_sample: int = typer.Option(50, min=1, help="fan-out forwards actually timed (the rest are the same cost)"),
    peer: str = typer.Option(None, help="vllm: also run vLLM on the same model and prompts (`make peers`)"),
    cuda_fast: bool = typer.Option(False, "--cuda-fast", help="CUDA: FA2 varlen + decode graphs (unverified)"),
    json_out: Path = typer.Option(None, "--json"),
):
    """One-pass scoring against one forward per candidate and one plain forward of as many tokens."""
    from genrec.bench.score import run

    report = run(prefix_len, candidates, candidate_len, preset, model, device, repeats, fanout_sample, peer, cuda_fast)
    _emit(report, json_out)


@bench_app.command("load")
def bench_load(
    kind: str = typer.Option("retrieve", help="retrieve | score | mixed"),
    rates: str = typer.Option("1,2,4", help="offered loads, requests per second"),
    duration: float = typer.Option(10.0, min=0.1, help="seconds of arrivals per rate"),
    preset: str = typer.Option("tiny"),
    model: Path = typer.Option(None),
    levels: int = typer.Option(None, min=1),
    prompt_len: int = typer.Option(2000, min=1),
    beam_width: int = typer.Option(30, min=1),
    candidates: int = typer.Option(100, min=1, help="candidates per score request"),
    device: str = typer.Option("cpu", callback=_device),
    burst: int = typer.Option(64, min=1, help="requests sent at once to measure saturation throughput"),
    max_running: int = typer.Option(
        None, min=1, help="requests the engine runs at once (default: 8 on CUDA, 64 on CPU)"
    ),
    cuda_fast: bool = typer.Option(False, "--cuda-fast", help="CUDA: FA2 varlen + decode graphs (unverified)"),
    threads: int = typer.Option(None, min=1, help="torch threads (default: torch's, one per core)"),
    pin: bool = typer.Option(False, "--pin", help="bind the threads to --threads cores (Linux; needs --threads)"),
    json_out: Path = typer.Option(None, "--json"),
    plot: Path = typer.Option(None, help="PNG: latency against offered load"),
):
    """Open-loop Poisson load on the in-process AsyncEngine, with sequential and saturation baselines."""
    from genrec.bench.common import parse_rates
    from genrec.bench.load import run

    if kind not in ("retrieve", "score", "mixed"):
        raise typer.BadParameter("kind must be retrieve, score or mixed")
    parsed = parse_rates(rates)
    report = run(
        kind,
        parsed,
        duration,
        preset,
        model,
        levels,
        prompt_len,
        beam_width,
        candidates,
        device,
        burst,
        plot,
        max_running,
        cuda_fast,
        threads,
        pin,
    )
    _emit(report, json_out)


@bench_app.command("threads")
def bench_threads(
    background: int = typer.Option(None, min=0, help="busy processes kept running (default: one per core)"),
    rounds: int = typer.Option(3, min=1, help="runs of every setting, in alternating order"),
    rate: float = typer.Option(2.0, help="offered load of each run's latency point, requests per second"),
    duration: float = typer.Option(8.0, min=0.1, help="seconds of arrivals per run"),
    burst: int = typer.Option(16, min=1, help="requests sent at once for each run's saturation throughput"),
    settle_s: float = typer.Option(60.0, min=0.0, help="seconds of background load before the first run"),
    prompt_len: int = typer.Option(2000, min=1),
    beam_width: int = typer.Option(30, min=1),
    preset: str = typer.Option("tiny"),
    model: Path = typer.Option(None, help="a model directory instead of the preset's"),
    json_out: Path = typer.Option(None, "--json"),
):
    """Engine thread settings on a contended machine: one thread and one per core, pinned (genrec.threads) and
    unpinned, each `bench load` in its own process while busy processes load every core."""
    from genrec.bench.common import check_rate
    from genrec.bench.threads import run

    load_args = ["--prompt-len", str(prompt_len), "--beam-width", str(beam_width)]
    load_args += ["--model", str(model)] if model else ["--preset", preset]
    _emit(run(background, rounds, check_rate(rate), duration, burst, load_args, settle_s), json_out)


@bench_app.command("returning")
def bench_returning(
    preset: str = typer.Option(
        None, help="a preset with a soft-token projector (default: realistic, hidden 512; tiny with --serve)"
    ),
    model: Path = typer.Option(None),
    device: str = typer.Option("cpu", callback=_device),
    events: int = typer.Option(
        None, min=2, help="history events in a prompt, x levels tokens (default: 400, 2000 tokens; 200 with --serve)"
    ),
    new_events: int = typer.Option(2, "--new-events", min=1, help="events a returning user adds per request"),
    users: int = typer.Option(None, min=1, help="returning users, Zipf popularity (default: 16; 8 with --serve)"),
    new_user_share: float = typer.Option(0.2, min=0.0, max=1.0, help="requests from first-time users"),
    burst: int = typer.Option(24, min=1, help="requests sent at once for the saturation figure"),
    rate: float = typer.Option(0.5, help="offered load for the p50/p99 figures, requests per second"),
    duration: float = typer.Option(20.0, min=0.1),
    repeats: int = typer.Option(5, min=1, help="returning requests timed for the single-user figure"),
    cuda_fast: bool = typer.Option(False, "--cuda-fast", help="CUDA: FA2 varlen + decode graphs (unverified)"),
    serve: bool = typer.Option(
        False,
        "--serve",
        help="instead: through a local Serve app with 2 engine replicas (CPU), reuse rate with "
        "genrec's user router and with Serve's default router against one replica",
    ),
    requests: int = typer.Option(40, min=1, help="--serve: requests after the users' first visits"),
    concurrency: int = typer.Option(2, min=1, help="--serve: requests in flight (one per user at a time)"),
    json_out: Path = typer.Option(None, "--json"),
):
    """Returning users (previous prompt + new events): prefix cache off vs on, and the two prompt layouts; with
    --serve, the reuse rate through Serve routed by user against Serve's default router."""
    if serve:
        from genrec.bench.returning_serve import run as run_serve

        if device != "cpu":
            raise ValueError("--serve runs its engine replicas on the CPU: drop --device")
        preset, events, users = preset or "tiny", events or 200, users or 8
        report = run_serve(preset, model, events, new_events, users, new_user_share, requests, concurrency)
        _emit(report, json_out)
        return
    from genrec.bench.common import check_rate
    from genrec.bench.returning import run

    check_rate(rate)
    preset, events, users = preset or "realistic", events or 400, users or 16
    report = run(
        preset, model, device, events, new_events, users, new_user_share, burst, rate, duration, repeats, cuda_fast
    )
    _emit(report, json_out)


@bench_app.command("rank")
def bench_rank(
    preset: str = typer.Option("tiny", help="HSTU preset (tiny: model dim 256, 4 layers, 4 heads, head dim 64)"),
    model: Path = typer.Option(None, help="an HSTU model directory instead of a preset"),
    device: str = typer.Option("cpu", callback=_device),
    events: int = typer.Option(2000, min=1, help="history events"),
    candidates: int = typer.Option(500, min=1),
    repeats: int = typer.Option(3, min=1),
    fanout_sample: int = typer.Option(20, min=1, help="one-candidate requests actually timed (scaled to all)"),
    new_events: int = typer.Option(10, min=1, help="events a returning user adds (warm vs cold)"),
    json_out: Path = typer.Option(None, "--json"),
):
    """HSTU ranking: one pass vs one request per candidate vs the plain masked forward; warm vs cold history."""
    import os

    from genrec.bench.rank import run

    root = Path(os.environ.get("GENREC_CACHE", Path.home() / ".cache" / "genrec")) / "presets"
    _emit(run(preset, model, device, events, candidates, repeats, fanout_sample, new_events, root), json_out)


@bench_app.command("funnel")
def bench_funnel(
    model: Path = typer.Option(None, help="a Qwen3 model directory (default: a tiny one, hidden 64, 2 layers)"),
    ranker: Path = typer.Option(None, help="an HSTU model directory (default: a tiny one, hidden 64, 2 layers)"),
    prompt_len: int = typer.Option(150, min=1, help="prompt tokens"),
    beam_width: int = typer.Option(50, min=1, help="retrieved items, all ranked"),
    events: int = typer.Option(50, min=1, help="history events"),
    requests: int = typer.Option(100, min=2, help="timed requests per route"),
    users: int = typer.Option(20, min=1, help="distinct prompts and histories, cycled"),
    warmup: int = typer.Option(5, min=0),
    json_out: Path = typer.Option(None, "--json"),
):
    """Two-stage /v1/recommend (Qwen3 retrieval, then HSTU ranking) against /v1/retrieve alone, through a local
    Serve app over HTTP: p50/p90 of each and their ratio."""
    from genrec.bench.funnel import run

    _emit(run(model, ranker, prompt_len, beam_width, events, requests, users, warmup), json_out)


@bench_app.command("serve")
def bench_serve(
    kind: str = typer.Option("retrieve", help="retrieve | score | mixed"),
    rates: str = typer.Option("2,4,8", help="offered loads, requests per second"),
    duration: float = typer.Option(10.0, min=0.1, help="seconds of arrivals per rate"),
    preset: str = typer.Option("small"),
    model: Path = typer.Option(None),
    levels: int = typer.Option(None),
    prompt_len: int = typer.Option(200, min=1),
    beam_width: int = typer.Option(32, min=1),
    candidates: int = typer.Option(100, min=1, help="candidates per score request"),
    burst: int = typer.Option(64, min=1, help="requests sent at once to measure saturation throughput"),
    json_out: Path = typer.Option(None, "--json"),
    plot: Path = typer.Option(None, help="PNG: latency against achieved throughput, both paths"),
):
    """Open-loop load through the Serve app over HTTP and on the in-process AsyncEngine, same run."""
    from genrec.bench.common import parse_rates
    from genrec.bench.serve import run

    if kind not in ("retrieve", "score", "mixed"):
        raise typer.BadParameter("kind must be retrieve, score or mixed")
    parsed = parse_rates(rates)
    report = run(kind, parsed, duration, preset, model, levels, prompt_len, beam_width, candidates, burst, plot)
    _emit(report, json_out)


@bench_app.command("soak")
def bench_soak(
    preset: str = typer.Option("tiny", help="a preset with a soft-token projector (recommend by user_id)"),
    model: Path = typer.Option(None),
    bursts: int = typer.Option(40, min=2, max=1000, help="bursts sent, one after another"),
    burst: int = typer.Option(100, min=1, max=2000, help="requests per burst"),
    concurrency: int = typer.Option(32, min=1, max=512, help="requests in flight within a burst"),
    prompt_len: int = typer.Option(48, min=8),
    beam_width: int = typer.Option(8, min=1),
    candidates: int = typer.Option(16, min=1, help="item candidates per score request"),
    kv_budget_bytes: int = typer.Option(64 << 20, min=1 << 20, help="the engine's KV pool (resident once written)"),
    prefix_cache_bytes: int = typer.Option(16 << 20, min=0, help="the prefix cache's share of the pool"),
    request_timeout_s: float = typer.Option(5.0, min=0.1, help="the app's deadline (504 past it)"),
    settle_s: float = typer.Option(1.0, min=0.0, help="wait after each burst before reading RSS"),
    max_seconds: float = typer.Option(900.0, min=10.0, max=7200.0, help="stop sending bursts after this long"),
    plateau_mb_per_1k: float = typer.Option(1.0, min=0.0, help="slope under which a process has plateaued"),
    json_out: Path = typer.Option(None, "--json"),
):
    """Memory under bursts: RSS of the ingress, engine, proxy and cache processes of a local Serve app after each
    burst of mixed requests (valid, invalid, unknown users, hang-ups); the second half's growth per 1,000
    requests and whether it plateaued. Bounded by --bursts and --max-seconds."""
    from genrec.bench.soak import run

    report = run(
        preset,
        model,
        bursts,
        burst,
        concurrency,
        prompt_len,
        beam_width,
        candidates,
        kv_budget_bytes,
        prefix_cache_bytes,
        request_timeout_s,
        settle_s,
        max_seconds,
        plateau_mb_per_1k,
    )
    _emit(report, json_out)


@bench_app.command("cache")
def bench_cache(
    keys: int = typer.Option(1_000_000, min=10, help="at least 10: the hit-rate table holds 10 %"),
    dim: int = typer.Option(128, min=1),
    batch: int = typer.Option(1000, min=1),
    zipf: float = typer.Option(1.1, min=0.0),
    batches: int = typer.Option(200, min=1, help="batches in the Zipf workload"),
    redis_url: str = typer.Option(None, help="default: start a private redis-server for the run"),
    json_out: Path = typer.Option(None, "--json"),
):
    """Embedding-cache get throughput (in-process, Ray actor, Redis MGET) and eviction-policy hit rates."""
    from genrec.bench.cache import run

    _emit(run(keys, dim, batch, zipf, batches, redis_url), json_out)


@bench_app.command("batch")
def bench_batch(
    users: int = typer.Option(2000, min=1),
    batch_size: int = typer.Option(32, min=1, help="users per engine call, in the loop and per shard in the job"),
    preset: str = typer.Option("tiny"),
    model: Path = typer.Option(None),
    levels: int = typer.Option(None),
    prompt_len: int = typer.Option(256, min=1),
    beam_width: int = typer.Option(16, min=1),
    actors: str = typer.Option("1,2", help="actor counts to run the job with (the first is compared to the loop)"),
    threads: int = typer.Option(1, min=1, help="torch threads of each engine: the loop's and every actor's"),
    ranker: Path = typer.Option(None, help="an HSTU directory: also the funnel (retrieve -> rank) against retrieve"),
    history_len: int = typer.Option(50, min=1, help="with --ranker: history events per user"),
    rank_actors: int = typer.Option(1, min=1, help="with --ranker: the funnel's ranking actors"),
    json_out: Path = typer.Option(None, "--json"),
):
    """Users/s of the Ray Data batch job against a plain loop over the in-process Engine; scaling with actors;
    with --ranker, the two-stage funnel's users/s against retrieve alone."""
    from genrec.bench.batch import run

    counts = [int(a) for a in actors.split(",") if a.strip()]
    report = run(
        users,
        batch_size,
        preset,
        model,
        levels,
        prompt_len,
        beam_width,
        counts,
        threads,
        ranker,
        history_len,
        rank_actors,
    )
    _emit(report, json_out)


@bench_app.command("suite")
def bench_suite(
    out: Path = typer.Option(Path("out/bench"), help="one JSON file per run"),
    device: str = typer.Option("cuda", callback=_device),
    preset: str = typer.Option("qwen3-1.7b"),
    only: str = typer.Option(None, help="comma-separated run names"),
):
    """The device benchmark runs in priority order (consistency, load, retrieve, score), isolated."""
    from genrec.bench.suite import run_suite

    _emit(run_suite(device, preset, out, only.split(",") if only else None), None)


def _emit(report: dict, json_out: Path | None) -> None:
    text = json.dumps(report, indent=2)
    typer.echo(text)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(text)
