"""`genrec bench catalog-reload`: a large catalog loaded live under load, then rolled back.

Closed-loop clients keep an AsyncEngine busy with beam retrieves over a 1 M-item catalog (OpenOneRec's 3 x 8,192
shape, sid_catalog.py's model). After a baseline window, a second version of the catalog (1 % of its items retired,
as many new ones added) is loaded from its Parquet file while the clients go on; later the first version is loaded
again (a rollback: kept built, a swap). Reported: every request's outcome, the latency percentiles of the requests
that overlapped each change against the baseline's, the engine's mean step time, and how long each change took.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from genrec.api import RetrieveRequest
from genrec.catalog import Catalog
from genrec.engine import AsyncEngine, Engine, SchedulerConfig
from genrec.engine.retriever import Retriever
from genrec_bench.cli import CatalogReloadOptions
from genrec_bench.common import machine, random_prompt
from genrec_bench.sid_catalog import random_catalog, sid_model

GOALS = {"failed": 0, "p99_during_over_before": "<= 1 + one step / p99 before"}


def run(o: CatalogReloadOptions) -> dict:
    directory, tokenizer, layout = sid_model(o)
    with tempfile.TemporaryDirectory() as scratch:
        first, second = _two_versions(layout, o, Path(scratch))
        dtype = torch.bfloat16 if o.device.startswith("cuda") else torch.float32
        model = directory.load_model(o.device, dtype)
        decoder = Retriever(model, tokenizer, Catalog.load(first, layout), None, layout)
        engine = AsyncEngine(Engine(decoder, SchedulerConfig(prefix_cache_bytes=0)))
        try:
            phases = _under_load(engine, o, first, second)
        finally:
            engine.shutdown(timeout_s=60)
    return _report(o, directory, phases)


def _two_versions(layout, o, scratch: Path) -> tuple[Path, Path]:
    """The catalog as served, and a version of it with `o.changed` of its items retired and as many added."""
    rng = np.random.default_rng(0)
    catalog, _ = random_catalog(layout, o.items, o.per_level, rng)
    fresh, _ = random_catalog(layout, int(o.items * o.changed), o.per_level, rng)
    kept = rng.permutation(o.items)[len(fresh) :]
    kept.sort()
    item_ids = np.concatenate([catalog.item_ids[kept], np.array([f"new{k}" for k in range(len(fresh))], object)])
    codes = np.concatenate([catalog.codes[kept], fresh.codes])
    first, second = scratch / "v1.parquet", scratch / "v2.parquet"
    catalog.save(first)
    Catalog(item_ids, codes).save(second)
    return first, second


class Clients:
    """`n` threads each sending one retrieve at a time: (start, end, catalog_version or the error) per request."""

    def __init__(self, engine: AsyncEngine, requests: list[RetrieveRequest], n: int):
        self.engine, self.requests, self.done = engine, requests, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(n)]

    def _client(self, k: int) -> None:
        i = k
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                outcome = self.engine.submit(self.requests[i % len(self.requests)], 600.0).result().catalog_version
            except Exception as err:  # noqa: BLE001 - counted, never expected
                outcome = err
            self.done.append((start, time.perf_counter(), outcome))
            i += len(self._threads)

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_):
        self._stop.set()
        for t in self._threads:
            t.join()


def _under_load(engine: AsyncEngine, o, first: Path, second: Path) -> dict:
    generator = torch.Generator().manual_seed(0)
    requests = [
        RetrieveRequest(prompt_token_ids=random_prompt(engine.engine, o.prompt_len, generator), beam_width=o.beam_width)
        for _ in range(16)
    ]
    with Clients(engine, requests, o.clients) as clients:
        time.sleep(o.warmup_s)
        steps, started = engine.engine.scheduler.metrics.steps, time.perf_counter()
        time.sleep(o.window_s)
        baseline = (started, time.perf_counter())
        step_s = (baseline[1] - started) / max(engine.engine.scheduler.metrics.steps - steps, 1)
        changes = {}
        for name, path in (("reload", second), ("rollback", first)):
            at = time.perf_counter()
            engine.load_catalog(path)
            changes[name] = (at, time.perf_counter())
            time.sleep(o.window_s)
    return {"done": clients.done, "baseline": baseline, "changes": changes, "step_s": step_s}


def _latencies(done: list, start: float, end: float) -> list[float]:
    """Requests that overlapped [start, end]: in flight at some point of it."""
    return [t1 - t0 for t0, t1, outcome in done if t1 >= start and t0 <= end and isinstance(outcome, str)]


def _percentiles(seconds: list[float]) -> dict:
    if not seconds:
        return {"requests": 0}
    ordered = np.sort(seconds)
    return {
        "requests": len(seconds),
        "p50_s": float(np.percentile(ordered, 50)),
        "p99_s": float(np.percentile(ordered, 99)),
        "max_s": float(ordered[-1]),
    }


def _versions_answered(done: list, baseline: tuple, changes: dict) -> dict:
    """The catalog versions answered by the requests that ran wholly inside the baseline, and wholly after each
    change returned (before the next began): one each, when a change serves every later request. Requests that
    overlapped a change may answer either version; ordering by end time would interleave them."""
    bounds = {"before": baseline}
    names = list(changes)
    for k, name in enumerate(names):
        bounds[f"after_{name}"] = (changes[name][1], changes[names[k + 1]][0] if k + 1 < len(names) else float("inf"))
    return {
        phase: sorted({v for t0, t1, v in done if isinstance(v, str) and t0 >= start and t1 <= end})
        for phase, (start, end) in bounds.items()
    }


def _report(o, directory, phases: dict) -> dict:
    done, step_s = phases["done"], phases["step_s"]
    before = _percentiles(_latencies(done, *phases["baseline"]))
    changes = {}
    for name, (at, finished) in phases["changes"].items():
        during = _percentiles(_latencies(done, at, finished))
        changes[name] = {
            "seconds": finished - at,
            **during,
            "p99_over_before": during.get("p99_s", 0) / before["p99_s"],
            "p99_excess_in_steps": (during.get("p99_s", 0) - before["p99_s"]) / step_s,
        }
    failed = sum(not isinstance(outcome, str) for _, _, outcome in done)
    return {
        "benchmark": "catalog-reload",
        "model": str(directory.path),
        "preset": o.preset,
        "device": o.device,
        "items": o.items,
        "changed_share": o.changed,
        "beam_width": o.beam_width,
        "prompt_len": o.prompt_len,
        "clients": o.clients,
        "requests": len(done),
        "failed": failed,
        "versions_answered": _versions_answered(done, phases["baseline"], phases["changes"]),
        "mean_step_s": step_s,
        "before": before,
        **changes,
        "goals": GOALS,
        "meets_goals": failed == 0 and all(c["p99_excess_in_steps"] <= 1.0 for c in changes.values()),
        "median_latency_s": statistics.median(t1 - t0 for t0, t1, _ in done) if done else None,
        "machine": machine(),
    }
