"""The one launcher of a local Serve app, for every bench that goes through Serve (serve, funnel, returning
--serve, soak): a local Ray of the bench's own with Serve on 127.0.0.1, and the app's arguments.

`app_args` is the only place that spells the app's arguments (genrec.serving.args): the benches say what they
need in their own terms (threads, CPUs, replicas, deadline, queue), so a change of the arguments' shape is a
change of that one function.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from genrec.errors import GenrecError
from genrec_bench.common import free_port


def app_args(
    model_dir: Path,
    *,
    threads: int = 1,
    engine_cpus: float = 1.0,
    timeout_s: float = 600.0,
    replicas: int = 1,
    router: str = "user",
    queue: int | None = None,
    in_flight: int | None = None,
    kv_budget_bytes: int | None = None,
    prefix_cache_bytes: int | None = None,
    cache=None,
    ranker: Path | None = None,
):
    """The app's arguments: `replicas` engine replicas of `threads` torch threads on `engine_cpus` CPUs each (and
    a ranker deployment of one such replica), routed by `router`, each engine queueing up to `queue` requests and
    its deployment holding `in_flight`; an ingress of 0.1 CPU with a deadline of `timeout_s`, resolving user IDs
    through `cache` (a CacheConfig). None leaves the app's default."""
    from genrec.serving.args import AppArgs

    cpus = {"ray_actor_options": {"num_cpus": engine_cpus}}
    deployment = cpus | {"num_replicas": replicas}
    if in_flight:
        deployment |= {"max_ongoing_requests": in_flight, "max_queued_requests": in_flight}
    retriever = {"model_dir": str(model_dir), "threads": threads, "router": router, "deployment": deployment}
    retriever |= {"kv_budget_bytes": kv_budget_bytes, "prefix_cache_bytes": prefix_cache_bytes}
    if queue:
        retriever["limits"] = {"max_queue": queue}
    ingress = {"limits": {"request_timeout_s": timeout_s}, "deployment": {"ray_actor_options": {"num_cpus": 0.1}}}
    return AppArgs(
        retriever=retriever,
        ranker={"model_dir": str(ranker), "threads": threads, "deployment": cpus} if ranker else None,
        ingress=ingress | ({"cache": cache} if cache is not None else {}),
    )


@contextlib.contextmanager
def local_serve():
    """A new local Ray of this process's own with Serve, HTTP on 127.0.0.1 (yields the base URL); all of it
    stopped afterwards, by the local Ray's shutdown: its Serve goes with it (a serve.shutdown first would wait out
    each replica's graceful shutdown, ~5 s, for nothing: the bench has measured and the whole cluster ends)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    if ray.is_initialized():
        raise GenrecError("this bench starts a Ray and a Serve of its own: run it in a fresh process")
    ray.init(address="local", include_dashboard=False, log_to_driver=False)  # never someone else's cluster
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        ray.shutdown()


def deploy(base: str, name: str, args) -> str:
    """The app built from `args`, run under /`name` of the local Serve at `base`; its URL."""
    from ray import serve

    from genrec.serving.app import build_app

    serve.run(build_app(args), name=name, route_prefix=f"/{name}")
    return f"{base}/{name}"


@contextlib.contextmanager
def local_app(name: str, args):
    """One app on a local Serve of its own (yields its URL)."""
    with local_serve() as base:
        yield deploy(base, name, args)
