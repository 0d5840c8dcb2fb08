"""`genrec bench returning --serve`: the returning-users workload through a local Serve app with 2 engine replicas.

One request sequence (returning.py's Workload, stable layout: each user's first visit, then `requests` requests
of Zipf-popular users, each their previous prompt plus k new events), replayed three times in one run:

- on one in-process AsyncEngine, the single-replica baseline (same KV budget and prefix cache as a replica);
- through Serve over HTTP, the engine deployment routed by user (genrec.serving.router.UserRouter);
- through Serve over HTTP, routed by Serve's default router (power of two choices).

A user's requests run one after another (a user sends their next request after the last answer), at most
`concurrency` in flight. Reported: the reuse rate (prefix-cache tokens reused / tokens prompted, summed over the
replicas, read from each replica through a handle) of the requests after the first visits, and its ratio to the
single replica's (goal for the user router: >= 0.9).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict

import httpx

from genrec.bench.common import machine, model_dir_for
from genrec.bench.returning import Workload
from genrec.engine import AsyncEngine, Engine, SchedulerConfig
from genrec.errors import GenrecError

REPLICAS = 2
ROUTERS = {"user_router": "user", "serve_default_router": "serve_default"}


def run(preset, model, events, k, users, new_share, requests, concurrency, kv_budget_bytes=512 << 20) -> dict:
    model_dir = model_dir_for(preset, model, None)
    engine = Engine.from_pretrained(model_dir)
    if engine.family.projector is None:
        raise ValueError("the returning-users bench puts a soft token in every prompt: use a model with a projector")
    first_visits, sequence = request_sequence(engine, events, k, users, new_share, requests)
    runs = {"single_replica": in_process(engine, first_visits, sequence, concurrency, kv_budget_bytes)}
    runs.update(through_serve(model_dir, first_visits, sequence, concurrency, kv_budget_bytes))
    single = runs["single_replica"]["reuse_rate"]
    return {
        "benchmark": "returning_serve",
        "model": str(model_dir),
        "preset": None if model else preset,
        "events": events,
        "new_events_per_request": k,
        "users": users,
        "new_user_share": new_share,
        "requests": requests,
        "concurrency": concurrency,
        "prompt_tokens_mean": sum(len(r.prompt_token_ids) for _, r in sequence) / len(sequence),
        "engine_replicas": REPLICAS,
        "runs": runs,
        "ratios": {f"{name}_over_single_replica": _ratio(runs[name]["reuse_rate"], single) for name in ROUTERS},
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
    config = SchedulerConfig(max_queue=4096, request_timeout_s=600, kv_budget_bytes=kv_budget_bytes)
    async_engine = AsyncEngine(Engine(engine.family, config, engine.model_version, fast=engine.runner.fast))
    try:

        async def call(user, request):
            await async_engine.retrieve(request)

        asyncio.run(replay(call, first_visits, concurrency))
        before = {"in_process": _snapshot(async_engine.metrics())}
        seconds = asyncio.run(replay(call, sequence, concurrency))
        after = asyncio.run(_settled(lambda: _in_process_stats(async_engine), before, len(sequence)))
    finally:
        async_engine.shutdown()
    return _reuse(before, after, seconds, len(sequence))


async def _in_process_stats(async_engine) -> dict[str, dict]:
    return {"in_process": _snapshot(async_engine.metrics())}


async def _settled(read, before: dict[str, dict], sent: int, wait_s: float = 5.0) -> dict[str, dict]:
    """Stats once every request sent is counted: an engine counts a request just after answering it."""
    deadline = time.monotonic() + wait_s
    while True:
        after = await read()
        counted = sum(a["requests"] - before.get(r, {}).get("requests", 0) for r, a in after.items())
        if counted >= sent or time.monotonic() > deadline:
            return after
        await asyncio.sleep(0.05)


def through_serve(model_dir, first_visits, sequence, concurrency, kv_budget_bytes) -> dict:
    """The same sequence through one app per router, one app at a time, on a local Ray of its own."""
    from ray import serve

    from genrec.bench.serve import local_serve_session
    from genrec.serving.app import build_app

    out = {}
    with local_serve_session() as base:
        for name, router in ROUTERS.items():
            app = f"returning-{router.replace('_', '-')}"
            serve.run(build_app(app_args(model_dir, router, kv_budget_bytes)), name=app, route_prefix=f"/{app}")
            try:
                out[name] = asyncio.run(_serve_run(f"{base}/{app}", app, first_visits, sequence, concurrency))
            finally:
                serve.delete(app)
    return out


def app_args(model_dir, router: str, kv_budget_bytes: int):
    from genrec.serving.args import AppArgs

    return AppArgs(
        model_dir=str(model_dir),
        engine_router=router,
        min_replicas=REPLICAS,
        max_replicas=REPLICAS,
        engine_num_cpus=0.5,  # two replicas, the ingress and the proxy fit on a 2-core machine
        torch_threads=1,
        ingress_num_cpus=0.1,
        kv_budget_bytes=kv_budget_bytes,
        request_timeout_s=600,
        limits={"max_queue": 4096},
    )


async def _serve_run(url, app, first_visits, sequence, concurrency) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:

        async def call(user, request):
            body = request.model_dump(exclude_none=True) | {"user_id": f"user-{user}"}  # inline vector wins
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


def _ratio(a, b):
    return a / b if a is not None and b else None
