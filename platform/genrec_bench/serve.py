"""Latency through a local Serve app over HTTP (127.0.0.1), against what it is compared with in the same run.

`bench serve`: the same open-loop load through the app and on the in-process AsyncEngine, on one model: saturation
(a burst) and Poisson rates in-process, then the same against the app (ingress + one engine replica with as many
torch threads). The ratios say what Serve costs: saturation through Serve / in-process, and the latency it adds to
one request at a time.

`bench funnel`: the two-stage recommend (Qwen3 retrieval, then HSTU ranking) against retrieval alone. One app with
a ranker, one request at a time: POST /v1/recommend with a `history` (both stages) and POST /v1/retrieve (the same
prompt and beam width) alternate, each user's prompt and history drawn once and sent on both routes. The ratio of
their p50s says what the ranking stage costs on top of retrieval (goal: <= 1.5 at the demo's sizes).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from genrec.engine import Engine
from genrec.errors import GenrecError, Overloaded
from genrec_bench.app import app_args, local_app
from genrec_bench.cli import FunnelOptions, ServeOptions
from genrec_bench.common import described, machine, model_dir_for, parse_rates, plot_latency, random_prompt
from genrec_bench.load import RequestMaker, burst_throughput, open_loop, serving

FUNNEL_GOAL = 1.5
APP = "bench"  # the app's name on the bench's own Serve


def serve(o: ServeOptions) -> dict:
    rates = parse_rates(o.rates)
    model_dir = model_dir_for(o.preset, o.model, o.levels)
    engine = Engine.from_pretrained(model_dir)
    maker = RequestMaker(engine, o.kind, o.prompt_len, o.beam_width, o.candidates)
    # As many torch threads as the in-process engine has; the app queues as much as the in-process one.
    args = app_args(model_dir, threads=torch.get_num_threads(), queue=4096, in_flight=4096)
    with serving(engine) as (_, in_process_call):
        in_process = asyncio.run(_measure(in_process_call, maker, rates, o.duration, o.burst))
        with local_app(APP, args) as url:
            measured = _measure_http(url, in_process_call, maker, rates, o.duration, o.burst, o.pairs)
            through, added = asyncio.run(measured)
    report = {
        "benchmark": "serve",
        "kind": o.kind,
        **described(model_dir, o, "prompt_len", "beam_width"),
        "levels": engine.catalog.levels,
        "in_process": in_process,
        "serve": through,
        "one_at_a_time": added,
        "ratios": {
            "saturation_serve_over_in_process": through["saturation"]["qps"] / in_process["saturation"]["qps"],
            "added_latency_ms_one_at_a_time": added["median_added_ms"],
        },
        "goals": {"saturation_serve_over_in_process": ">= 0.8", "added_latency_ms_one_at_a_time": "<= 10"},
        "note": "in-process: the engine shares this process (and its GIL) with the load generator; through "
        "Serve it runs in a replica process of its own with as many torch threads",
        "machine": machine(),
    }
    if o.plot:
        curves, lines = [], []
        for side, style in (("in_process", "-"), ("serve", "--")):
            shown = [p for p in report[side]["rates"] if p["p50_s"] is not None]
            for key, color in (("p50_s", "tab:blue"), ("p99_s", "tab:red")):
                label, achieved = f"{side.replace('_', '-')} {key[:3]}", [p["achieved_qps"] for p in shown]
                curves.append((label, achieved, [p[key] for p in shown], {"linestyle": style, "color": color}))
            lines.append((report[side]["saturation"]["qps"], {"linestyle": style, "color": "grey"}))
        title = f"genrec {o.kind} through Serve vs in-process (prompt {o.prompt_len})"
        plot_latency(o.plot, title, "achieved throughput (requests / s); grey: saturation", curves, lines)
    return report


async def _measure_http(url, in_process_call, maker, rates, duration, burst, pairs) -> tuple[dict, dict]:
    limits = httpx.Limits(max_connections=burst + 16, max_keepalive_connections=burst + 16)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def http_call(request):
            route = "retrieve" if request.__class__.__name__ == "RetrieveRequest" else "score"
            response = await client.post(f"{url}/v1/{route}", json=request.model_dump(exclude_none=True))
            if response.status_code == 503:
                raise Overloaded(response.text)
            if response.status_code != 200:
                raise GenrecError(f"HTTP {response.status_code}: {response.text[:200]}")
            return response.json()

        added = await _added_latency(in_process_call, http_call, _handle_call(), maker, pairs)
        return await _measure(http_call, maker, rates, duration, burst), added


def _handle_call():
    """The engine deployment called through a Serve handle from here: Serve's replica hop without its HTTP proxy
    and the ingress (where the added latency goes, split: docs/benchmarks.md, "bench serve")."""
    from ray import serve

    from genrec.serving.args import DEPLOYMENTS

    handle = serve.get_deployment_handle(DEPLOYMENTS["retriever"], app_name=APP)

    async def call(request):
        method = "retrieve" if request.__class__.__name__ == "RetrieveRequest" else "score"
        return await getattr(handle, method).remote(request, 600.0)

    return call


async def _measure(call, maker, rates, duration, burst) -> dict:
    saturation = await burst_throughput(call, maker, burst)
    return {"saturation": saturation, "rates": [await open_loop(call, maker, rate, duration) for rate in rates]}


async def _added_latency(in_process_call, http_call, handle_call, maker, pairs: int) -> dict:
    """One request at a time (no queueing), the same request on each path back to back (in-process, through a Serve
    handle to the engine replica, over HTTP through the proxy and the ingress), the order alternating: the median of
    the per-request differences is what each hop adds, whatever the machine's drift."""
    paths = {"local": in_process_call, "handle": handle_call, "http": http_call}
    for call in paths.values():
        await call(maker())
    timed = {name: [] for name in paths}
    for i in range(pairs):
        request = maker()
        for name, call in list(paths.items())[:: 1 if i % 2 else -1]:
            start = time.perf_counter()
            await call(request)
            timed[name].append(time.perf_counter() - start)

    def added_ms(slow: str, fast: str) -> float:
        return 1000 * statistics.median(s - f for s, f in zip(timed[slow], timed[fast], strict=True))

    return {
        "pairs": pairs,
        "in_process_median_ms": 1000 * statistics.median(timed["local"]),
        "handle_median_ms": 1000 * statistics.median(timed["handle"]),
        "serve_median_ms": 1000 * statistics.median(timed["http"]),
        "median_added_ms": added_ms("http", "local"),
        "replica_hop_added_ms": added_ms("handle", "local"),  # the engine replica: Serve's call, pickling
        "proxy_and_ingress_added_ms": added_ms("http", "handle"),  # HTTP, the proxy, the ingress and its hop
    }


def funnel(o: FunnelOptions) -> dict:
    with tempfile.TemporaryDirectory(prefix="genrec-funnel-") as scratch:
        model, ranker = _funnel_models(o.model, o.ranker, Path(scratch))
        bodies = _funnel_bodies(model, ranker, o)
        args = app_args(model, engine_cpus=0.5, timeout_s=120, ranker=ranker)  # one torch thread per engine
        with local_app("funnel", args) as url:
            timed = _measure_funnel(url, bodies, o.requests, o.warmup)
    two_stage, retrieve, stage1 = (_p50_p90(timed[k]) for k in ("two_stage", "retrieve", "recommend"))
    return {
        "benchmark": "funnel",
        "model": str(model),
        "ranker": str(ranker),
        "prompt_tokens": o.prompt_len,
        "beam_width": o.beam_width,
        "history_events": o.events,
        "ranked_candidates_median": statistics.median(timed["ranked"]),
        "users": o.users,
        "requests_each": o.requests,
        "two_stage": two_stage,
        "retrieve": retrieve,
        "recommend_without_history": stage1,
        "ratios": {
            "two_stage_p50_over_retrieve_p50": two_stage["p50_ms"] / retrieve["p50_ms"],
            "two_stage_p90_over_retrieve_p90": two_stage["p90_ms"] / retrieve["p90_ms"],
        },
        "goals": {"two_stage_p50_over_retrieve_p50": f"<= {FUNNEL_GOAL}"},
        "note": "one request at a time over HTTP, the two routes alternating; each engine replica has one torch "
        "thread; two-stage = /v1/recommend with history: retrieval (every beam) then the ranker",
        "machine": machine(),
    }


def _funnel_models(model: Path | None, ranker: Path | None, scratch: Path) -> tuple[Path, Path]:
    """The given directories, else tiny ones of the demo's shapes (hidden 64, 2 layers, random weights)."""
    if model is None:
        from genrec.testing.tiny import ModelSpec, write_model_dir

        model = write_model_dir(scratch / "qwen3", ModelSpec(hidden=64, layers=2))
    if ranker is None:
        from genrec.testing.tiny import HSTUSpec, write_hstu_dir

        ranker = write_hstu_dir(scratch / "hstu", HSTUSpec(hidden=64, layers=2))
    return Path(model), Path(ranker)


def _funnel_bodies(model: Path, ranker: Path, o: FunnelOptions) -> list[dict]:
    """One two-stage body per user: a random prompt of ordinary tokens and a history of the ranker's items."""
    retriever, hstu = Engine.from_pretrained(model), Engine.from_pretrained(ranker)
    g = torch.Generator().manual_seed(0)
    items, actions = hstu.catalog.item_ids, hstu.model.config.num_actions
    bodies = []
    for user in range(o.users):
        picks = torch.randint(0, len(items), (o.events,), generator=g).tolist()
        kinds = torch.randint(0, actions, (o.events,), generator=g).tolist()
        history = [
            {"item_id": items[i], "action": a, "timestamp": 1e9 + 60.0 * t}
            for t, (i, a) in enumerate(zip(picks, kinds, strict=True))
        ]
        prompt = random_prompt(retriever, o.prompt_len, g)
        scope = f"user-{user}"  # each user's prompt and history reused by their own next requests (cycled)
        bodies.append(
            {"prompt_token_ids": prompt, "beam_width": o.beam_width, "history": history, "cache_scope": scope}
        )
    return bodies


def _measure_funnel(url: str, bodies: list[dict], requests: int, warmup: int) -> dict[str, list[float]]:
    timed = {"two_stage": [], "retrieve": [], "recommend": [], "ranked": []}
    with httpx.Client(timeout=120) as client:
        for i in range(warmup + requests):
            body = bodies[i % len(bodies)]
            retrieve = {k: v for k, v in body.items() if k != "history"}  # the same prompt and beam
            calls = [("two_stage", "recommend", body), ("retrieve", "retrieve", retrieve)]
            calls.append(("recommend", "recommend", retrieve))  # stage 1 alone: what the ranking stage adds to
            for name, route, sent in calls[:: 1 if i % 2 else -1]:  # alternate which goes first
                started = time.perf_counter()
                response = client.post(f"{url}/v1/{route}", json=sent)
                elapsed = time.perf_counter() - started
                if response.status_code != 200:
                    raise GenrecError(f"/v1/{route}: HTTP {response.status_code}: {response.text[:300]}")
                if i >= warmup:
                    timed[name].append(elapsed)
                    if name == "two_stage":
                        items = response.json()["items"]
                        timed["ranked"].append(sum(item["ranker_scores"] is not None for item in items))
    return timed


def _p50_p90(seconds: list[float]) -> dict:
    q = statistics.quantiles(seconds, n=10)
    return {"p50_ms": 1000 * statistics.median(seconds), "p90_ms": 1000 * q[8], "n": len(seconds)}
