"""`genrec bench load`: open-loop Poisson arrivals against the in-process AsyncEngine.

Per offered rate: achieved QPS, latency percentiles, errors. In the same run, the sequential baseline
(1 / the time of one request alone) and the saturation throughput (a burst, served as fast as the loop can).
`--threads N` sets torch's threads and `--pin` binds them to N cores (genrec.threads), as an engine replica's
`torch_threads` / `pin_threads` do; the report gives the 1-minute load average around the run.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import statistics
import time

import torch

from genrec.api import Candidate, RetrieveRequest, ScoreRequest
from genrec.bench.common import check_rate, machine, model_dir_for, random_prompt, synchronize
from genrec.engine import AsyncEngine, Engine, SchedulerConfig
from genrec.errors import GenrecError, Overloaded
from genrec.threads import apply_threads, check_thread_settings


def run(
    kind,
    rates,
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
    max_running: int | None = None,
    cuda_fast: bool = False,
    threads: int | None = None,
    pin: bool = False,
):
    rates = [check_rate(rate) for rate in rates]  # before minutes of model loading
    check_thread_settings(threads, pin, threads_name="--threads", pin_name="--pin")
    model_dir = model_dir_for(preset, model, levels)
    applied = apply_threads(threads, pin, threads_name="--threads", pin_name="--pin")  # before the model loads
    load_before = _load_average()
    engine = Engine.from_pretrained(model_dir, device=device, cuda_fast=cuda_fast)
    maker = RequestMaker(engine, kind, prompt_len, beam_width, candidates)
    sequential_s = _sequential_seconds(engine, maker, device)
    config = SchedulerConfig(max_queue=4096, max_running=max_running, request_timeout_s=600)
    async_engine = AsyncEngine(Engine(engine.family, config, engine.model_version, fast=engine.runner.fast))
    try:
        call = functools.partial(call_engine, async_engine)
        saturation = asyncio.run(burst_throughput(call, maker, burst))
        points = [asyncio.run(open_loop(call, maker, rate, duration)) for rate in rates]
        metrics = async_engine.metrics()
    finally:
        async_engine.shutdown()
    report = {
        "benchmark": "load",
        "kind": kind,
        "model": str(model_dir),
        "preset": None if model else preset,
        "device": device,
        "prompt_len": prompt_len,
        "beam_width": beam_width,
        "levels": engine.catalog.levels,
        "candidates": candidates if kind != "retrieve" else None,
        "max_running": async_engine.scheduler.config.max_running,
        "sequential": {"seconds_per_request": sequential_s, "qps": 1.0 / sequential_s},
        "saturation": saturation,
        "ratios": {"saturation_over_sequential": saturation["qps"] / (1.0 / sequential_s)},
        "rates": points,
        "engine_metrics": {
            "batch_rows_per_step": metrics["batch_rows_per_step"],
            "prefill_tokens_per_step": metrics["prefill_tokens_per_step"],
        },
        "threads": {**applied.as_dict(), "pin": pin},
        "load_average_1m": {"start": load_before, "end": _load_average()},
        "machine": machine(),
    }
    if plot:
        _plot(report, plot)
    return report


def _load_average() -> float | None:
    """The machine's 1-minute load average (None where the OS has none): how busy it was around the run."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


class RequestMaker:
    def __init__(self, engine, kind, prompt_len, beam_width, candidates):
        self.engine, self.kind = engine, kind
        self.prompt_len, self.beam_width, self.candidates = prompt_len, beam_width, candidates
        self.generator = torch.Generator().manual_seed(0)
        self.count = 0

    def __call__(self):
        self.count += 1
        prompt = random_prompt(self.engine, self.prompt_len, self.generator)  # unique: no context reuse
        kind = self.kind if self.kind != "mixed" else ("retrieve", "score")[self.count % 2]
        if kind == "retrieve":
            return RetrieveRequest(prompt_token_ids=prompt, beam_width=self.beam_width)
        items = torch.randint(0, len(self.engine.catalog), (self.candidates,), generator=self.generator).tolist()
        return ScoreRequest(
            prompt_token_ids=prompt, candidates=[Candidate(item_id=self.engine.catalog.item_ids[i]) for i in items]
        )


def _run_sync(engine, request):
    return engine.retrieve([request]) if isinstance(request, RetrieveRequest) else engine.score([request])


def _sequential_seconds(engine, maker, device, repeats: int = 5) -> float:
    requests = [maker() for _ in range(repeats + 1)]
    _run_sync(engine, requests[0])  # warm-up
    times = []
    for request in requests[1:]:
        synchronize(device)
        start = time.perf_counter()
        _run_sync(engine, request)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def call_engine(async_engine, request):
    if isinstance(request, RetrieveRequest):
        return await async_engine.retrieve(request)
    return await async_engine.score(request)


async def burst_throughput(call, maker, count: int) -> dict:
    """Saturation: `count` requests sent at once, served as fast as the server can. `call` is async."""
    await call(maker())  # warm-up through the loop
    requests = [maker() for _ in range(count)]
    start = time.perf_counter()
    await asyncio.gather(*(call(r) for r in requests))
    elapsed = time.perf_counter() - start
    return {"requests": count, "seconds": elapsed, "qps": count / elapsed}


async def open_loop(call, maker, rate: float, duration: float) -> dict:
    """Poisson arrivals at `rate` for `duration` seconds; latency percentiles of what completed."""
    rng = random.Random(int(check_rate(rate) * 1000))
    latencies, errors, overloaded = [], 0, 0

    async def one(request):
        nonlocal errors, overloaded
        start = time.perf_counter()
        try:
            await call(request)
            latencies.append(time.perf_counter() - start)
        except Overloaded:
            overloaded += 1
        except Exception:  # noqa: BLE001 - counted, reported
            errors += 1

    tasks, begin = [], time.perf_counter()
    next_at = begin
    while next_at - begin < duration:
        request = maker()  # built before its arrival time, outside the measured latency
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        tasks.append(asyncio.ensure_future(one(request)))
        next_at += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - begin
    ordered = sorted(latencies)

    def pct(q):
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None

    return {
        "offered_qps": rate,
        "sent": len(tasks),
        "completed": len(latencies),
        "achieved_qps": len(latencies) / elapsed,
        "p50_s": pct(0.5),
        "p90_s": pct(0.9),
        "p99_s": pct(0.99),
        "errors": errors,
        "overloaded": overloaded,
    }


def _plot(report: dict, path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise GenrecError("--plot needs matplotlib: pip install 'genrec[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in report["rates"] if p["p50_s"] is not None]
    offered = [p["offered_qps"] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (("p50_s", "p50"), ("p90_s", "p90"), ("p99_s", "p99")):
        ax.plot(offered, [p[key] * 1000 for p in points], marker="o", label=label)
    ax.axvline(report["saturation"]["qps"], color="grey", linestyle="--", label="saturation (burst)")
    ax.axvline(report["sequential"]["qps"], color="black", linestyle=":", label="sequential")
    ax.set_xlabel("offered load (requests / s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title(
        f"genrec {report['kind']}: prompt {report['prompt_len']}, beam {report['beam_width']}, "
        f"{report['levels']} levels ({report['device']})"
    )
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
