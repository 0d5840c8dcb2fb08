"""Open-loop load: the load generator (Poisson arrivals, bursts) and the benches built on it.

`bench load`: Poisson arrivals against the in-process AsyncEngine. Per offered rate: achieved QPS, latency
percentiles, errors. In the same run, the sequential baseline (1 / the time of one request alone) and the saturation
throughput (a burst, served as fast as the loop can). `--threads N` sets torch's threads and `--pin` binds them to N
cores (genrec.threads), as an engine replica's `threads` / `pin_threads` do; the report gives the 1-minute load
average around the run.

`bench threads`: an engine's thread settings on a busy machine, pinned against unpinned. Each setting (torch
threads, bound to cores or not) runs `genrec bench load` in its own process (a process's binding cannot be undone),
while `--background` busy processes keep the cores contended: with one per core about cores + the engine's threads
are runnable (3-4 on 2 cores). Settings alternate round by round so drifts in the machine's load fall on all of them
alike. Per setting, the medians over rounds of one request alone, the saturation throughput and the latency at
`--rate` (a setting that saturates below it queues: its latencies grow with the run), the load seen during its runs,
and ratios against the unpinned setting with as many threads (and against torch's default: one thread per core,
unpinned). Binding as many threads as the machine has cores binds them to every core: a control (any difference
from unbound is noise). "bound per thread" is not an engine option: it sets libgomp's OMP_PROC_BIND/OMP_PLACES (one
core per thread, fixed at process start), measured to see whether it is worth one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from genrec.api import Candidate, RetrieveRequest, ScoreRequest
from genrec.engine import AsyncEngine, Engine, SchedulerConfig
from genrec.errors import Overloaded
from genrec.threads import apply_threads, available_cores, check_thread_settings
from genrec_bench.cli import LoadOptions, ThreadsOptions
from genrec_bench.common import (
    check_rate,
    described,
    machine,
    model_dir_for,
    parse_rates,
    plot_latency,
    random_prompt,
    timed,
)

# ---------------------------------------------------------------------------------------------- the generator


class RequestMaker:
    """A new request at each call: a random prompt (unique: no context reuse); `kind` retrieve, score or mixed."""

    def __init__(self, engine, kind, prompt_len, beam_width, candidates):
        self.engine, self.kind = engine, kind
        self.prompt_len, self.beam_width, self.candidates = prompt_len, beam_width, candidates
        self.generator = torch.Generator().manual_seed(0)
        self.count = 0

    def __call__(self):
        self.count += 1
        prompt = random_prompt(self.engine, self.prompt_len, self.generator)
        kind = self.kind if self.kind != "mixed" else ("retrieve", "score")[self.count % 2]
        if kind == "retrieve":
            return RetrieveRequest(prompt_token_ids=prompt, beam_width=self.beam_width)
        # distinct items: a score through Serve refuses an item given twice
        items = torch.randperm(len(self.engine.catalog), generator=self.generator)[: self.candidates].tolist()
        return ScoreRequest(
            prompt_token_ids=prompt, candidates=[Candidate(item_id=self.engine.catalog.item_ids[i]) for i in items]
        )


async def call_engine(async_engine, request):
    if isinstance(request, RetrieveRequest):
        return await async_engine.retrieve(request)
    return await async_engine.score(request)


@contextlib.contextmanager
def serving(engine: Engine, **config):
    """An AsyncEngine over `engine`'s weights with a scheduler (and KV pool) of its own, queue 4096 and a 600 s
    deadline unless `config` says otherwise, and an async call of it; shut down afterwards. The one place a bench
    makes an AsyncEngine: the synchronous engine keeps its own scheduler for the sequential figures."""
    config = SchedulerConfig(**{"max_queue": 4096, "request_timeout_s": 600, **config})
    own = Engine(
        engine.family, config, engine.model_version, plan=engine.plan, graph_max_rows=engine.runner.graph_max_rows
    )
    async_engine = AsyncEngine(own)  # the engine's plan: on CUDA its own captures, as a replica's
    try:
        yield async_engine, functools.partial(call_engine, async_engine)
    finally:
        async_engine.shutdown()


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


# ------------------------------------------------------------------------------------------------ bench load


def run(o: LoadOptions) -> dict:
    rates = parse_rates(o.rates)  # before minutes of model loading
    check_thread_settings(o.threads, o.pin, threads_name="--threads", pin_name="--pin")
    model_dir = model_dir_for(o.preset, o.model, o.levels)
    applied = apply_threads(o.threads, o.pin, threads_name="--threads", pin_name="--pin")  # before the model loads
    load_before = _load_average()
    engine = Engine.from_pretrained(model_dir, device=o.device, cuda_fast=o.cuda_fast)
    maker = RequestMaker(engine, o.kind, o.prompt_len, o.beam_width, o.candidates)
    sequential_s = _sequential_seconds(engine, maker, o.device)
    with serving(engine, max_running=o.max_running) as (async_engine, call):
        saturation = asyncio.run(burst_throughput(call, maker, o.burst))
        points = [asyncio.run(open_loop(call, maker, rate, o.duration)) for rate in rates]
        metrics = async_engine.metrics()
    report = {
        "benchmark": "load",
        "kind": o.kind,
        **described(model_dir, o, "device", "prompt_len", "beam_width"),
        "levels": engine.catalog.levels,
        "candidates": o.candidates if o.kind != "retrieve" else None,
        "max_running": async_engine.scheduler.config.max_running,
        "sequential": {"seconds_per_request": sequential_s, "qps": 1.0 / sequential_s},
        "saturation": saturation,
        "ratios": {"saturation_over_sequential": saturation["qps"] / (1.0 / sequential_s)},
        "rates": points,
        "engine_metrics": {key: metrics[key] for key in ("batch_rows_per_step", "prefill_tokens_per_step")},
        "threads": {**applied.as_dict(), "pin": o.pin},
        "load_average_1m": {"start": load_before, "end": _load_average()},
        "machine": machine(),
    }
    if o.plot:
        shown = [p for p in points if p["p50_s"] is not None]
        offered = [p["offered_qps"] for p in shown]
        plot_latency(
            o.plot,
            f"genrec {o.kind}: prompt {o.prompt_len}, beam {o.beam_width}, {engine.catalog.levels} levels ({o.device})",
            "offered load (requests / s)",
            [(key[:3], offered, [p[key] for p in shown], {}) for key in ("p50_s", "p90_s", "p99_s")],
            [
                (saturation["qps"], {"color": "grey", "linestyle": "--", "label": "saturation (burst)"}),
                (1.0 / sequential_s, {"color": "black", "linestyle": ":", "label": "sequential"}),
            ],
        )
    return report


def _load_average() -> float | None:
    """The machine's 1-minute load average (None where the OS has none): how busy it was around the run."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _sequential_seconds(engine, maker, device, repeats: int = 5) -> float:
    def alone(request):
        return engine.retrieve([request]) if isinstance(request, RetrieveRequest) else engine.score([request])

    requests = [maker() for _ in range(repeats + 1)]
    alone(requests[0])  # warm-up
    return statistics.median(timed(functools.partial(alone, r), device) for r in requests[1:])


# --------------------------------------------------------------------------------------------- bench threads


@dataclass(frozen=True)
class Setting:
    name: str
    threads: int
    pin: bool = False
    env: tuple[tuple[str, str], ...] = ()  # set at the process's start


PER_THREAD_BINDING = (("OMP_PROC_BIND", "close"), ("OMP_PLACES", "cores"))  # libgomp: thread i on core i


def settings_for(cores: int) -> list[Setting]:
    """One thread and one thread per core, each unpinned and pinned (and per-thread bound where >1 thread)."""
    chosen = [Setting("1 thread", 1), Setting("1 thread, pinned", 1, pin=True)]
    if cores > 1:
        chosen += [
            Setting(f"{cores} threads", cores),
            Setting(f"{cores} threads, pinned", cores, pin=True),
            Setting(f"{cores} threads, bound per thread", cores, env=PER_THREAD_BINDING),
        ]
    return chosen


class BackgroundLoad:
    """`count` processes spinning in pure Python, one core's worth of load each, until the block ends."""

    def __init__(self, count: int):
        self.count = count
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> BackgroundLoad:
        try:
            for _ in range(self.count):
                self.processes.append(subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"]))
        except BaseException:
            self.__exit__()  # those already spinning end here too
            raise
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.wait()


def read_loadavg() -> tuple[float, int] | None:
    """(1-minute load average, runnable threads now besides the reader) from /proc/loadavg (whose count includes
    the thread reading it); None where there is none."""
    try:
        fields = Path("/proc/loadavg").read_text().split()
    except OSError:
        return None
    return float(fields[0]), int(fields[3].split("/")[0]) - 1


def load_args(o: ThreadsOptions) -> list[str]:
    """The options every setting's `bench load` shares: the request shape and the model."""
    model = ["--model", str(o.model)] if o.model else ["--preset", o.preset]
    return ["--prompt-len", str(o.prompt_len), "--beam-width", str(o.beam_width), *model]


def run_setting(setting: Setting, o: ThreadsOptions, interval_s: float = 0.5) -> dict:
    """One `genrec bench load` run of `setting` in a fresh process; its figures, and the load average and the
    runnable threads (an instant reading, where the average lags by a minute) sampled every `interval_s` meanwhile."""
    env = {**os.environ, "OMP_NUM_THREADS": str(setting.threads), **dict(setting.env)}
    samples = []
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile("w+") as log:
        out = Path(tmp) / "load.json"
        command = [sys.executable, "-m", "genrec.cli", "bench", "load", "--rates", str(o.rate)]
        command += ["--duration", str(o.duration), "--burst", str(o.burst), "--threads", str(setting.threads)]
        command += ["--json", str(out), *load_args(o), *(["--pin"] if setting.pin else [])]
        with subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log) as process:
            while True:
                try:
                    process.wait(interval_s)
                    break
                except subprocess.TimeoutExpired:
                    reading = read_loadavg()
                    if reading is not None:
                        samples.append(reading)
        if process.returncode != 0:
            log.seek(0)
            raise RuntimeError(f"bench load for {setting.name!r} failed:\n{log.read()[-2000:]}")
        report = json.loads(out.read_text())
    point = report["rates"][0]
    return {
        "sequential_s": report["sequential"]["seconds_per_request"],
        "saturation_qps": report["saturation"]["qps"],
        "p50_s": point["p50_s"],
        "p99_s": point["p99_s"],
        "pinned_cores": report["threads"]["pinned_cores"],
        "load_average_1m_mean": statistics.fmean(a for a, _ in samples) if samples else None,
        "runnable_threads_mean": statistics.fmean(r for _, r in samples) if samples else None,
    }


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per setting, the median of each figure over its rounds (None where a round had none)."""
    figures = ("sequential_s", "saturation_qps", "p50_s", "p99_s", "load_average_1m_mean", "runnable_threads_mean")
    summary = {}
    for name, rounds in runs.items():
        pinned = [r["pinned_cores"] for r in rounds if r["pinned_cores"] is not None]
        summary[name] = {"rounds": len(rounds), "pinned_cores": pinned or None}  # per round: the slot is the PID
        for figure in figures:
            values = [r[figure] for r in rounds if r[figure] is not None]
            summary[name][figure] = statistics.median(values) if values else None
    return summary


def ratios(summary: dict[str, dict], settings: list[Setting], default: str) -> dict[str, dict]:
    """Each setting against the unpinned one with as many threads, and against `default`: time ratios below 1
    and the throughput ratio above 1 mean better."""

    def against(name: str, base: str) -> dict:
        mine, theirs = summary[name], summary[base]
        out = {"baseline": base}
        for figure in ("saturation_qps", "sequential_s", "p50_s", "p99_s"):
            if mine[figure] is not None and theirs[figure]:
                out[figure] = mine[figure] / theirs[figure]
        return out

    unpinned = {s.threads: s.name for s in settings if not s.pin and not s.env}
    result = {}
    for setting in settings:
        entry = {"vs_torch_default": against(setting.name, default)} if setting.name != default else {}
        if setting.name != unpinned[setting.threads]:
            entry["vs_unpinned"] = against(setting.name, unpinned[setting.threads])
        result[setting.name] = entry
    return result


def threads(o: ThreadsOptions) -> dict:
    check_rate(o.rate)
    cores = len(available_cores())
    background = cores if o.background is None else o.background
    settings = settings_for(cores)
    runs: dict[str, list[dict]] = {s.name: [] for s in settings}
    with BackgroundLoad(background):
        time.sleep(o.settle_s)  # the 1-minute load average climbs to the background's level
        for round_index in range(o.rounds):
            for setting in settings if round_index % 2 == 0 else settings[::-1]:
                runs[setting.name].append(run_setting(setting, o))
    summary = summarize(runs)
    default = next(s.name for s in settings if s.threads == cores and not s.pin and not s.env)
    return {
        "benchmark": "threads",
        "cores": cores,
        "background_processes": background,
        "rounds": o.rounds,
        "settle_s": o.settle_s,
        "offered_qps": o.rate,
        "load_args": load_args(o),
        "settings": summary,
        "ratios": ratios(summary, settings, default),
        "runs": runs,
        "machine": machine(),
    }
