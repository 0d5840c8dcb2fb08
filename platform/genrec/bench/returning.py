"""`genrec bench returning`: returning users, whose prompt is their previous one plus a few new events.

U users with Zipf popularity; a request comes from a new user with probability `new_share`, else from a
returning one, whose history grows by `k` events (each event an item's semantic-ID code). Two prompt layouts:

- stable (the one that reuses): history first, oldest first, truncated from the front in large steps; the
  per-request part (the soft token, at the end) last;
- sliding: the soft token first, then the last N events (the window moves with every request: nothing reuses).

Reported, each with the prefix cache off and on (same workload, same run): one returning user's retrieve
latency (all but the new events cached) against a cold one; saturation QPS (a burst) and p50/p99 at a fixed
offered load; the reuse rate (tokens reused / tokens prompted).
"""

from __future__ import annotations

import asyncio
import functools
import random
import statistics
import time

import numpy as np
import torch

from genrec.api import RetrieveRequest
from genrec.bench.common import machine, model_dir_for, synchronize
from genrec.bench.load import burst_throughput, call_engine, open_loop
from genrec.engine import AsyncEngine, Engine, SchedulerConfig
from genrec.engine.scheduler import Scheduler


class Workload:
    """Requests of returning users; `layout` is "stable" or "sliding" (see the module's doc)."""

    def __init__(self, engine: Engine, events: int, k: int, users: int, new_share: float, layout: str, seed=0):
        self.engine, self.events, self.k, self.layout = engine, events, k, layout
        self.new_share, self.step = new_share, max(events // 10, k)  # truncation step: a tenth of the window
        self.rng = random.Random(seed)
        self.generator = torch.Generator().manual_seed(seed)
        weights = 1.0 / np.arange(1, users + 1) ** 1.1
        self.popularity = (weights / weights.sum()).tolist()
        self.histories: dict[int, list[int]] = {}
        self.vectors: dict[int, list[float]] = {}
        self.next_user = users

    def __call__(self) -> RetrieveRequest:
        if self.rng.random() < self.new_share:
            user, self.next_user = self.next_user, self.next_user + 1
        else:
            user = self.rng.choices(range(len(self.popularity)), self.popularity)[0]
        if user not in self.histories:
            self.first_visit(user)
        else:
            self.histories[user] += self._items(self.k)
        self.last_user = user  # who sent it: the Serve part (returning_serve.py) routes by it
        return self.request(user)

    def first_visit(self, user: int) -> None:
        """A new user's history: room for `step` more events before the stable layout truncates."""
        self.histories[user] = self._items(self.events - self.step)
        self.vectors[user] = torch.randn(self.engine.family.projector.user_dim, generator=self.generator).tolist()

    def request(self, user: int) -> RetrieveRequest:
        codes = self.engine.catalog.codes
        history = self.histories[user]
        placeholder = [self.engine.family.placeholder_id]
        if self.layout == "stable":  # drop the oldest `step` events at once, only when over the window
            while len(history) > self.events:
                del history[: self.step]
            tokens = codes[history].reshape(-1).tolist() + placeholder
        else:  # a window as long as a new user's history: it moves from the first return on
            tokens = placeholder + codes[history[-(self.events - self.step) :]].reshape(-1).tolist()
        return RetrieveRequest(prompt_token_ids=tokens, user_embedding=self.vectors[user], beam_width=30)

    def _items(self, n: int) -> list[int]:
        return torch.randint(0, len(self.engine.catalog), (n,), generator=self.generator).tolist()


def returning_latency(engine: Engine, events: int, k: int, repeats: int, device: str) -> dict:
    """One returning user, request after request (each k events more), cache on against cache off."""
    out = {}
    for name, cache in (("cold", 0), ("warm", None)):
        scheduler_engine = Engine(engine.family, SchedulerConfig(prefix_cache_bytes=cache), engine.model_version)
        workload = Workload(scheduler_engine, events, k, users=1, new_share=0.0, layout="stable")
        scheduler_engine.retrieve([workload()])  # the user's first visit (and warm-up)
        times = []
        for _ in range(repeats):
            request = workload()
            synchronize(device)
            start = time.perf_counter()
            scheduler_engine.retrieve([request])
            synchronize(device)
            times.append(time.perf_counter() - start)
        out[f"{name}_s"] = statistics.median(times)
        out["prompt_tokens"] = len(request.prompt_token_ids)
    out["cold_over_warm"] = out["cold_s"] / out["warm_s"]
    return out


def workload_run(engine, args, layout: str, cache_bytes: int | None) -> dict:
    config = SchedulerConfig(max_queue=4096, request_timeout_s=600, prefix_cache_bytes=cache_bytes)
    async_engine = AsyncEngine(Engine(engine.family, config, engine.model_version, fast=engine.runner.fast))
    workload = Workload(engine, args["events"], args["k"], args["users"], args["new_share"], layout, seed=1)
    try:
        call = functools.partial(call_engine, async_engine)
        for user in range(args["users"]):  # first visits: the users' histories enter the cache
            workload.first_visit(user)
            asyncio.run(call(workload.request(user)))
        before = dict(async_engine.metrics()["prefix_cache"])
        saturation = asyncio.run(burst_throughput(call, workload, args["burst"]))
        latency = asyncio.run(open_loop(call, workload, args["rate"], args["duration"]))
        after = async_engine.metrics()["prefix_cache"]
    finally:
        async_engine.shutdown()
    prompted = after["tokens_prompted"] - before["tokens_prompted"]
    reused = after["tokens_reused"] - before["tokens_reused"]
    return {
        "saturation": saturation,
        "at_rate": latency,
        "reuse_rate": reused / prompted if prompted else 0.0,
        "evictions": after["evictions"] - before["evictions"],
        "bytes_held": after["bytes_held"],
    }


def admission(engine: Engine, events: int, k: int, users: int, requests: int = 60) -> dict:
    """The cache's admission rule, measured: half the requests are one-off prompts (users never seen again) and
    the cache holds about half the returning users' prompts. Reuse rate of the same request sequence under the
    segmented LRU (probation, then protected once reused) and under a plain LRU."""
    per_token = Scheduler(engine, SchedulerConfig(prefix_cache_bytes=0, kv_budget_bytes=1 << 20)).per_token
    capacity = per_token * events * engine.family.levels * max(users // 2, 1)
    out = {}
    for name, protected_share in (("segmented_lru", 0.8), ("plain_lru", 0.0)):
        sync = Engine(engine.family, SchedulerConfig(prefix_cache_bytes=capacity), engine.model_version)
        cache = sync.scheduler.cache
        cache.protected_limit = int(capacity * protected_share)
        workload = Workload(sync, events, k, users, new_share=0.5, layout="stable", seed=2)
        for user in range(users):
            workload.first_visit(user)
            sync.retrieve([workload.request(user)])
        before = dict(cache.snapshot())
        for _ in range(requests):
            sync.retrieve([workload()])
        after = cache.snapshot()
        prompted = after["tokens_prompted"] - before["tokens_prompted"]
        out[name] = {
            "reuse_rate": (after["tokens_reused"] - before["tokens_reused"]) / prompted,
            "evictions": after["evictions"] - before["evictions"],
        }
    out["capacity_bytes"] = capacity
    return out


def run(preset, model, device, events, k, users, new_share, burst, rate, duration, repeats, cuda_fast=False) -> dict:
    model_dir = model_dir_for(preset, model, None)
    engine = Engine.from_pretrained(model_dir, device=device, cuda_fast=cuda_fast)
    if engine.family.projector is None:
        raise ValueError("the returning-users bench puts a soft token in every prompt: use a model with a projector")
    args = dict(events=events, k=k, users=users, new_share=new_share, burst=burst, rate=rate, duration=duration)
    single = returning_latency(engine, events, k, repeats, device)
    runs = {
        "stable_cache_off": workload_run(engine, args, "stable", 0),
        "stable_cache_on": workload_run(engine, args, "stable", None),
        "sliding_cache_on": workload_run(engine, args, "sliding", None),
    }
    off, on = runs["stable_cache_off"], runs["stable_cache_on"]
    admitted = admission(engine, events, k, users)
    return {
        "benchmark": "returning",
        "model": str(model_dir),
        "preset": None if model else preset,
        "device": device,
        "levels": engine.catalog.levels,
        "events": events,
        "new_events_per_request": k,
        "users": users,
        "new_user_share": new_share,
        "single_user": single,
        "workload": runs,
        "admission": admitted,
        "ratios": {
            "returning_cold_over_warm": single["cold_over_warm"],
            "saturation_cache_on_over_off": on["saturation"]["qps"] / off["saturation"]["qps"],
            "p50_cache_off_over_on": _ratio(off["at_rate"]["p50_s"], on["at_rate"]["p50_s"]),
            "reuse_segmented_over_plain_lru": _ratio(
                admitted["segmented_lru"]["reuse_rate"], admitted["plain_lru"]["reuse_rate"]
            ),
        },
        "machine": machine(),
    }


def _ratio(a, b):
    return a / b if a and b else None
