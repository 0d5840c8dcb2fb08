"""`genrec bench serve`: the same open-loop load through the Serve app over HTTP and on the in-process AsyncEngine.

In one run, on one model: saturation (a burst) and Poisson rates against the in-process AsyncEngine, then the
same against a local Serve app (ingress + one engine replica with as many torch threads) over HTTP on
127.0.0.1. The ratios say what Serve costs: saturation through Serve / in-process, and the latency it adds to
one request at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import statistics
import time

import httpx
import torch

from genrec.bench.common import free_port, machine, model_dir_for
from genrec.bench.load import RequestMaker, burst_throughput, call_engine, open_loop
from genrec.engine import AsyncEngine, Engine, SchedulerConfig
from genrec.errors import GenrecError, Overloaded

APP = "bench"


def run(kind, rates, duration, preset, model, levels, prompt_len, beam_width, candidates, burst, plot) -> dict:
    model_dir = model_dir_for(preset, model, levels)
    engine = Engine.from_pretrained(model_dir)
    maker = RequestMaker(engine, kind, prompt_len, beam_width, candidates)
    async_engine = AsyncEngine(Engine(engine.family, SchedulerConfig(max_queue=4096, request_timeout_s=600)))
    try:
        in_process_call = functools.partial(call_engine, async_engine)
        in_process = asyncio.run(_measure(in_process_call, maker, rates, duration, burst))
        with _local_serve(model_dir) as url:
            serve, added = asyncio.run(_measure_http(url, in_process_call, maker, rates, duration, burst))
    finally:
        async_engine.shutdown()
    report = {
        "benchmark": "serve",
        "kind": kind,
        "model": str(model_dir),
        "preset": None if model else preset,
        "prompt_len": prompt_len,
        "beam_width": beam_width,
        "levels": engine.catalog.levels,
        "in_process": in_process,
        "serve": serve,
        "one_at_a_time": added,
        "ratios": {
            "saturation_serve_over_in_process": serve["saturation"]["qps"] / in_process["saturation"]["qps"],
            "added_latency_ms_one_at_a_time": added["median_added_ms"],
        },
        "goals": {"saturation_serve_over_in_process": ">= 0.8", "added_latency_ms_one_at_a_time": "<= 10"},
        "note": "in-process: the engine shares this process (and its GIL) with the load generator; through "
        "Serve it runs in a replica process of its own with as many torch threads",
        "machine": machine(),
    }
    if plot:
        _plot(report, plot)
    return report


async def _measure_http(url, in_process_call, maker, rates, duration, burst) -> tuple[dict, dict]:
    async with httpx.AsyncClient(timeout=600, limits=_connections(burst)) as client:
        http_call = functools.partial(_post, client, url)
        added = await _added_latency(in_process_call, http_call, maker)
        return await _measure(http_call, maker, rates, duration, burst), added


async def _measure(call, maker, rates, duration, burst) -> dict:
    saturation = await burst_throughput(call, maker, burst)
    points = [await open_loop(call, maker, rate, duration) for rate in rates]
    return {"saturation": saturation, "rates": points}


async def _added_latency(in_process_call, http_call, maker, pairs: int = 25) -> dict:
    """One request at a time (no queueing), the same request on both paths back to back, alternating which
    goes first: the median of the per-pair differences is what Serve adds, whatever the machine's drift."""
    await in_process_call(maker())
    await http_call(maker())
    local, http, added = [], [], []
    for i in range(pairs):
        request = maker()
        timed = {}
        for name, call in (("local", in_process_call), ("http", http_call))[:: 1 if i % 2 else -1]:
            start = time.perf_counter()
            await call(request)
            timed[name] = time.perf_counter() - start
        local.append(timed["local"])
        http.append(timed["http"])
        added.append(timed["http"] - timed["local"])
    return {
        "pairs": pairs,
        "in_process_median_ms": 1000 * statistics.median(local),
        "serve_median_ms": 1000 * statistics.median(http),
        "median_added_ms": 1000 * statistics.median(added),
    }


async def _post(client: httpx.AsyncClient, url: str, request):
    route = "retrieve" if request.__class__.__name__ == "RetrieveRequest" else "score"
    response = await client.post(f"{url}/v1/{route}", json=request.model_dump(exclude_none=True))
    if response.status_code == 503:
        raise Overloaded(response.text)
    if response.status_code != 200:
        raise GenrecError(f"HTTP {response.status_code}: {response.text[:200]}")
    return response.json()


def _connections(burst: int) -> httpx.Limits:
    return httpx.Limits(max_connections=burst + 16, max_keepalive_connections=burst + 16)


@contextlib.contextmanager
def local_serve_session():
    """A new local Ray of this process's own with Serve, HTTP on 127.0.0.1 (yields the base URL); all of it
    stopped afterwards."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    if ray.is_initialized():
        raise GenrecError("this bench starts a Ray and a Serve of its own: run it in a fresh process")
    ray.init(address="local", include_dashboard=False, log_to_driver=False)  # never someone else's cluster
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()
    finally:
        ray.shutdown()


@contextlib.contextmanager
def _local_serve(model_dir):
    """The app (ingress + one engine replica) on a local Ray of its own."""
    from ray import serve

    from genrec.serving.app import build_app
    from genrec.serving.args import AppArgs

    args = AppArgs(
        model_dir=str(model_dir),
        torch_threads=torch.get_num_threads(),  # as many as the in-process engine had
        engine_num_cpus=1,
        ingress_num_cpus=0.1,
        request_timeout_s=600,
        limits={"max_queue": 4096},
        max_ongoing_requests=4096,
        max_queued_requests=4096,
    )
    with local_serve_session() as base:
        serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
        yield f"{base}/{APP}"


def _plot(report: dict, path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise GenrecError("--plot needs matplotlib: pip install 'genrec[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for side, style in (("in_process", "-"), ("serve", "--")):
        points = [p for p in report[side]["rates"] if p["p50_s"] is not None]
        achieved = [p["achieved_qps"] for p in points]
        for key, color in (("p50_s", "tab:blue"), ("p99_s", "tab:red")):
            label = f"{side.replace('_', '-')} {key[:3]}"
            ax.plot(achieved, [p[key] * 1000 for p in points], style, marker="o", color=color, label=label)
        ax.axvline(report[side]["saturation"]["qps"], linestyle=style, color="grey")
    ax.set_xlabel("achieved throughput (requests / s); grey: saturation")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title(f"genrec {report['kind']} through Serve vs in-process (prompt {report['prompt_len']})")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
