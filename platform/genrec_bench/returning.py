"""`genrec bench returning`: returning users, whose prompt is their previous one plus a few new events.

U users with Zipf popularity; a request comes from a new user with probability `new_share`, else from a
returning one, whose history grows by `k` events (each event an item's semantic-ID code). Two prompt layouts:

- stable (the one that reuses): history first, oldest first, truncated from the front in large steps; the
  per-request part (the soft token, at the end) last;
- sliding: the soft token first, then the last N events (the window moves with every request: nothing reuses).

Reported, each with the prefix cache off and on (same workload, same run): one returning user's retrieve
latency (all but the new events cached) against a cold one; saturation QPS (a burst) and p50/p99 at a fixed
offered load; the reuse rate (tokens reused / tokens prompted); the cache's admission rule against a plain LRU.

With `--serve`, one request sequence (stable layout: each user's first visit, then `requests` requests of
Zipf-popular users) replayed three times: on one in-process AsyncEngine (the single-replica baseline, same KV
budget and prefix cache as a replica), then through a local Serve app with 2 engine replicas over HTTP, routed by
user (genrec.serving.router.UserRouter), then routed by Serve's default router (power of two choices). A user
sends their next request after the last answer, at most `concurrency` in flight. Reported: the reuse rate of the
requests after the first visits (summed over the replicas, read from each through a handle) and its ratio to the
single replica's (goal for the user router: >= 0.9).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random
import statistics
import time
from collections import defaultdict

import httpx
import numpy as np
import torch

from genrec.api import RetrieveRequest
from genrec.engine import Engine, SchedulerConfig
from genrec.engine.scheduler import Scheduler
from genrec.errors import GenrecError
from genrec_bench.app import app_args, deploy, local_serve
from genrec_bench.cli import ReturningOptions
from genrec_bench.common import check_rate, decoder, described, machine, model_dir_for, ratio, timed
from genrec_bench.load import burst_throughput, open_loop, serving

REPLICAS = 2
ROUTERS = {"user_router": "user", "serve_default_router": "serve_default"}
SERVE_KV_BUDGET = 512 << 20  # per engine, in-process and in each replica


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
        self.last_user = user  # who sent it: the Serve replay routes by it
        return self.request(user)

    def first_visit(self, user: int) -> None:
        """A new user's history: room for `step` more events before the stable layout truncates."""
        self.histories[user] = self._items(self.events - self.step)
        self.vectors[user] = torch.randn(decoder(self.engine).projector.user_dim, generator=self.generator).tolist()

    def request(self, user: int) -> RetrieveRequest:
        codes = self.engine.catalog.codes
        history = self.histories[user]
        placeholder = [decoder(self.engine).placeholder_id]
        if self.layout == "stable":  # drop the oldest `step` events at once, only when over the window
            while len(history) > self.events:
                del history[: self.step]
            tokens = codes[history].reshape(-1).tolist() + placeholder
        else:  # a window as long as a new user's history: it moves from the first return on
            tokens = placeholder + codes[history[-(self.events - self.step) :]].reshape(-1).tolist()
        # Each user's own cache scope: their prompts are reused by their own later requests only.
        return RetrieveRequest(
            prompt_token_ids=tokens, user_embedding=self.vectors[user], beam_width=30, cache_scope=f"user-{user}"
        )

    def _items(self, n: int) -> list[int]:
        return torch.randint(0, len(self.engine.catalog), (n,), generator=self.generator).tolist()


def run(o: ReturningOptions) -> dict:
    if o.serve:
        if o.device != "cpu":
            raise ValueError("--serve runs its engine replicas on the CPU: drop --device")
        return run_serve(dataclasses.replace(o, preset=o.preset or "tiny", events=o.events or 200, users=o.users or 8))
    check_rate(o.rate)
    o = dataclasses.replace(o, preset=o.preset or "realistic", events=o.events or 400, users=o.users or 16)
    model_dir, engine = _engine(o, cuda_fast=o.cuda_fast)
    single = returning_latency(model_dir, engine, o)
    runs = {
        "stable_cache_off": workload_run(engine, o, "stable", 0),
        "stable_cache_on": workload_run(engine, o, "stable", None),
        "sliding_cache_on": workload_run(engine, o, "sliding", None),
    }
    off, on = runs["stable_cache_off"], runs["stable_cache_on"]
    admitted = admission(model_dir, engine, o)
    return {
        "benchmark": "returning",
        **described(model_dir, o, "device"),
        "levels": engine.catalog.levels,
        "events": o.events,
        "new_events_per_request": o.new_events,
        "users": o.users,
        "new_user_share": o.new_user_share,
        "single_user": single,
        "workload": runs,
        "admission": admitted,
        "ratios": {
            "returning_cold_over_warm": single["cold_over_warm"],
            "saturation_cache_on_over_off": on["saturation"]["qps"] / off["saturation"]["qps"],
            "p50_cache_off_over_on": ratio(off["at_rate"]["p50_s"], on["at_rate"]["p50_s"]),
            "reuse_segmented_over_plain_lru": ratio(
                admitted["segmented_lru"]["reuse_rate"], admitted["plain_lru"]["reuse_rate"]
            ),
        },
        "machine": machine(),
    }


def _engine(o: ReturningOptions, **options):
    model_dir = model_dir_for(o.preset, o.model, None)
    engine = Engine.from_pretrained(model_dir, device=o.device, **options)
    if decoder(engine).projector is None:
        raise ValueError("the returning-users bench puts a soft token in every prompt: use a model with a projector")
    return model_dir, engine


def returning_latency(model_dir, engine: Engine, o: ReturningOptions) -> dict:
    """One returning user, request after request (each k events more), cache on against cache off."""
    out = {}
    for name, cache in (("cold", 0), ("warm", None)):
        sync = Engine.from_pretrained(model_dir, device=o.device, scheduler=SchedulerConfig(prefix_cache_bytes=cache))
        workload = Workload(sync, o.events, o.new_events, users=1, new_share=0.0, layout="stable")
        sync.retrieve([workload()])  # the user's first visit (and warm-up)
        requests = [workload() for _ in range(o.repeats)]
        out[f"{name}_s"] = statistics.median(timed(functools.partial(sync.retrieve, [r]), o.device) for r in requests)
        out["prompt_tokens"] = len(requests[-1].prompt_token_ids)
    out["cold_over_warm"] = out["cold_s"] / out["warm_s"]
    return out


def workload_run(engine, o: ReturningOptions, layout: str, cache_bytes: int | None) -> dict:
    workload = Workload(engine, o.events, o.new_events, o.users, o.new_user_share, layout, seed=1)
    with serving(engine, prefix_cache_bytes=cache_bytes) as (async_engine, call):
        for user in range(o.users):  # first visits: the users' histories enter the cache
            workload.first_visit(user)
            asyncio.run(call(workload.request(user)))
        before = dict(async_engine.metrics()["prefix_cache"])
        saturation = asyncio.run(burst_throughput(call, workload, o.burst))
        latency = asyncio.run(open_loop(call, workload, o.rate, o.duration))
        after = async_engine.metrics()["prefix_cache"]
    prompted = after["tokens_prompted"] - before["tokens_prompted"]
    return {
        "saturation": saturation,
        "at_rate": latency,
        "reuse_rate": (after["tokens_reused"] - before["tokens_reused"]) / prompted if prompted else 0.0,
        "evictions": after["evictions"] - before["evictions"],
        "bytes_held": after["bytes_held"],
    }


def admission(model_dir, engine: Engine, o: ReturningOptions, requests: int = 60) -> dict:
    """The cache's admission rule, measured: half the requests are one-off prompts (users never seen again) and
    the cache holds about half the returning users' prompts. Reuse rate of the same request sequence under the
    segmented LRU (probation, then protected once reused) and under a plain LRU (the cache's protected share set
    to 0 directly: no engine option says it)."""
    config = SchedulerConfig(prefix_cache_bytes=0, kv_budget_bytes=1 << 20)
    per_token = Scheduler(engine.family, engine.runner, config).per_token
    capacity = per_token * o.events * decoder(engine).levels * max(o.users // 2, 1)
    out = {}
    for name, protected_share in (("segmented_lru", 0.8), ("plain_lru", 0.0)):
        config = SchedulerConfig(prefix_cache_bytes=capacity)
        sync = Engine.from_pretrained(model_dir, device=o.device, scheduler=config)
        cache = sync.scheduler.cache
        cache.protected_limit = int(capacity * protected_share)
        workload = Workload(sync, o.events, o.new_events, o.users, new_share=0.5, layout="stable", seed=2)
        for user in range(o.users):
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


# ------------------------------------------------------------------------------------------------- --serve


def run_serve(o: ReturningOptions) -> dict:
    from ray import serve

    model_dir, engine = _engine(o)
    first_visits, sequence = request_sequence(engine, o.events, o.new_events, o.users, o.new_user_share, o.requests)
    runs = {"single_replica": in_process(engine, first_visits, sequence, o.concurrency, SERVE_KV_BUDGET)}
    with local_serve() as base:  # one app per router, one after the other
        for name, router in ROUTERS.items():
            app = f"returning-{router.replace('_', '-')}"
            args = app_args(
                model_dir,
                engine_cpus=0.5,
                replicas=REPLICAS,
                router=router,
                queue=4096,
                kv_budget_bytes=SERVE_KV_BUDGET,
            )  # two replicas, the ingress and the proxy fit on a 2-core machine
            url = deploy(base, app, args)
            try:
                runs[name] = asyncio.run(_serve_run(url, app, first_visits, sequence, o.concurrency))
            finally:
                serve.delete(app)
    return {
        "benchmark": "returning_serve",
        **described(model_dir, o, "events"),
        "new_events_per_request": o.new_events,
        "users": o.users,
        "new_user_share": o.new_user_share,
        "requests": o.requests,
        "concurrency": o.concurrency,
        "prompt_tokens_mean": sum(len(r.prompt_token_ids) for _, r in sequence) / len(sequence),
        "engine_replicas": REPLICAS,
        "runs": runs,
        "ratios": {
            f"{name}_over_single_replica": ratio(runs[name]["reuse_rate"], runs["single_replica"]["reuse_rate"])
            for name in ROUTERS
        },
        "goals": {"user_router_over_single_replica": ">= 0.9"},
        "machine": machine(),
    }


def request_sequence(engine, events, k, users, new_share, requests) -> tuple[list, list]:
    """(user, request) pairs: every user's first visit, then the measured requests, in sending order."""
    workload = Workload(engine, events, k, users, new_share, "stable", seed=1)
    first_visits = []
    for user in range(users):
        workload.first_visit(user)
        first_visits.append((user, workload.request(user)))
    sequence = []
    for _ in range(requests):
        request = workload()
        sequence.append((workload.last_user, request))
    return first_visits, sequence


async def replay(call, sequence, concurrency: int) -> float:
    """Send in order, one request per user at a time, at most `concurrency` in flight; the seconds it took."""
    per_user = defaultdict(asyncio.Lock)
    slots = asyncio.Semaphore(concurrency)

    async def one(user, request):
        async with per_user[user], slots:
            await call(user, request)

    start = time.perf_counter()
    await asyncio.gather(*(one(user, request) for user, request in sequence))
    return time.perf_counter() - start


def in_process(engine, first_visits, sequence, concurrency, kv_budget_bytes) -> dict:
    with serving(engine, kv_budget_bytes=kv_budget_bytes) as (async_engine, _):

        async def call(user, request):
            await async_engine.retrieve(request)

        async def stats():
            return {"in_process": _snapshot(async_engine.metrics())}

        asyncio.run(replay(call, first_visits, concurrency))
        before = asyncio.run(stats())
        seconds = asyncio.run(replay(call, sequence, concurrency))
        after = asyncio.run(_settled(stats, before, len(sequence)))
    return _reuse(before, after, seconds, len(sequence))


async def _settled(read, before: dict[str, dict], sent: int, wait_s: float = 5.0) -> dict[str, dict]:
    """Stats once every request sent is counted: an engine counts a request just after answering it."""
    deadline = time.monotonic() + wait_s
    while True:
        after = await read()
        counted = sum(a["requests"] - before.get(r, {}).get("requests", 0) for r, a in after.items())
        if counted >= sent or time.monotonic() > deadline:
            return after
        await asyncio.sleep(0.05)


async def _serve_run(url, app, first_visits, sequence, concurrency) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:

        async def call(user, request):
            # The user's ID scopes the cache (the ingress's default scope) and routes; the inline vector wins.
            body = request.model_dump(exclude_none=True, exclude={"cache_scope"}) | {"user_id": f"user-{user}"}
            response = await client.post(f"{url}/v1/retrieve", json=body)
            if response.status_code != 200:
                raise GenrecError(f"HTTP {response.status_code}: {response.text[:200]}")

        await replay(call, first_visits, concurrency)
        before = await replica_cache_stats(app)
        seconds = await replay(call, sequence, concurrency)
        after = await _settled(lambda: replica_cache_stats(app), before, len(sequence))
    return _reuse(before, after, seconds, len(sequence))


async def replica_cache_stats(app: str, replicas: int = REPLICAS, tries: int = 200) -> dict[str, dict]:
    """Each engine replica's prefix-cache stats (and request counts), asked through a handle: a random routing
    key (user router) or a random pick (Serve's default) reaches every replica within a few tries."""
    from ray import serve

    from genrec.serving.router import ROUTING_KEY

    handle = serve.get_deployment_handle("EngineServer", app_name=app)
    stats: dict[str, dict] = {}
    for i in range(tries):
        answer = await handle.stats.remote(**{ROUTING_KEY: f"probe-{random.random()}-{i}"})
        stats[answer["replica"]] = _snapshot(answer["metrics"])
        if len(stats) == replicas:
            return stats
    raise GenrecError(f"reached {len(stats)} of {replicas} engine replicas of {app} in {tries} tries")


def _snapshot(metrics: dict) -> dict:
    """An engine's prefix-cache totals and the retrieve requests it has answered."""
    return {**metrics["prefix_cache"], "requests": metrics["requests"].get("retrieve:ok", 0)}


def _reuse(before: dict[str, dict], after: dict[str, dict], seconds: float, count: int) -> dict:
    """Tokens reused / prompted over the replicas, between two snapshots."""
    per_replica = {}
    for replica, end in after.items():
        start = before.get(replica, {})
        per_replica[replica] = {
            key: end.get(key, 0) - start.get(key, 0) for key in ("requests", "tokens_prompted", "tokens_reused")
        }
    prompted = sum(r["tokens_prompted"] for r in per_replica.values())
    reused = sum(r["tokens_reused"] for r in per_replica.values())
    return {
        "reuse_rate": reused / prompted if prompted else 0.0,
        "tokens_prompted": prompted,
        "tokens_reused": reused,
        "seconds": seconds,
        "requests_per_s": count / seconds,
        "per_replica": per_replica,
    }
