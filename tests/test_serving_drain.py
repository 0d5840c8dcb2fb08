"""Every request ends by its deadline, counted from its arrival, and a replaced ingress finishes its requests:
Serve waits longer than a request's deadline before it kills a replaced ingress replica (its graceful shutdown),
so a request in flight ends with genrec's JSON answer by its deadline, never the HTTP proxy's plain-text 500.
Settings and the edge's arrival time first, without Ray; then a real Serve app under load, redeployed so that its
ingress and its ranker are replaced and the new ranker never starts."""

import asyncio
import itertools
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from fastapi import FastAPI
from pydantic import ValidationError

from genrec.serving import edge
from genrec.serving.args import DRAIN_MARGIN_S, AppArgs, IngressLimits
from genrec.serving.schemas import RetrieveBody
from tests.serve_apps import delete, deploy, deploy_started, deployment_states, replica_actor_names


def ingress(**fields):
    return AppArgs(retriever={"model_dir": "/m"}, ingress=fields).ingress


def test_serve_waits_for_a_replaced_ingress_longer_than_a_deadline():
    section = ingress(limits={"request_timeout_s": 25})
    options = section.deployment_options(section.defaults())
    assert options["graceful_shutdown_timeout_s"] == 25 + DRAIN_MARGIN_S == section.drain_s()
    assert ingress().drain_s() == 30 + DRAIN_MARGIN_S  # Serve's own default, 20 s, is below the default deadline
    longer = ingress(limits={"request_timeout_s": 25}, deployment={"graceful_shutdown_timeout_s": 90})
    assert longer.deployment_options(longer.defaults())["graceful_shutdown_timeout_s"] == 90


def test_a_drain_shorter_than_the_deadline_is_refused_naming_the_field():
    with pytest.raises(ValidationError, match="graceful_shutdown_timeout_s") as error:
        ingress(limits={"request_timeout_s": 25}, deployment={"graceful_shutdown_timeout_s": 20})
    assert "at least 30" in str(error.value)


def test_a_live_deadline_the_drain_cannot_cover_is_refused_and_the_running_one_stays():
    section = ingress(limits={"request_timeout_s": 25})
    running = IngressLimits(request_timeout_s=25)
    assert section.live({"request_timeout_s": 10}, running) == (IngressLimits(request_timeout_s=10), None)
    assert section.live({"request_timeout_s": 25}, running)[1] is None  # just covered
    kept, refused = section.live({"request_timeout_s": 25.5}, running)
    assert kept is running and f"graceful_shutdown_timeout_s of at least {25.5 + DRAIN_MARGIN_S:g}" in refused
    kept, refused = section.live({"request_timeout_s": -1}, running)  # what live_limits refuses, as before
    assert kept is running and "request_timeout_s" in refused


def test_a_deadline_counts_from_the_requests_arrival_its_body_included():
    """The route reads when the request reached the edge (edge.arrived), before its body had arrived; outside a
    request, now."""
    api, seen = FastAPI(), {}
    edge.install(api, edge.EdgeSettings(body_timeout_s=5.0, routes=frozenset({"/v1/retrieve"})))

    @api.post("/v1/retrieve")
    async def retrieve(body: RetrieveBody):
        seen["since_arrival"] = time.monotonic() - edge.arrived()
        return {}

    chunks = [b'{"prompt": "user listened", ', b'"beam_width": 4}']

    async def receive():
        await asyncio.sleep(0.3)  # a body that takes its time
        chunk = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message):
        if message["type"] == "http.response.start":
            seen["status"] = message["status"]

    scope = {"type": "http", "method": "POST", "path": "/v1/retrieve", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json")]}  # fmt: skip
    asyncio.run(api(scope, receive, send))
    assert seen["status"] == 200 and seen["since_arrival"] >= 0.6, seen  # both chunks' waits counted
    assert abs(edge.arrived() - time.monotonic()) < 0.1


# -- redeploys that replace the ingress and its ranker, under load ----------------------------------------------

DEADLINE_S = 26.0  # over Serve's default graceful shutdown (20 s), which killed requests in flight
LATE_S = 3.0  # past its deadline, what an answer may take on a loaded 2-core machine (proxy, threads)


def funnel_args(tiny_dir, hstu_dir, max_candidates: int, ranker_gone: bool, retry_after_s: int = 1) -> dict:
    """`ranker_gone`: a ranker no node can host, and no surge (Serve stops the old one first; the new one never
    starts, so its stop need not wait out Serve's 20 s)."""
    gone = {"ray_actor_options": {"num_cpus": 64}, "graceful_shutdown_timeout_s": 1, "max_surge_percent": 0}
    ranker = gone if ranker_gone else {}
    return {
        "retriever": {"model_dir": str(tiny_dir), "threads": 1},
        "ranker": {
            "model_dir": str(hstu_dir),
            "max_candidates": max_candidates,
            "deployment": {"ray_actor_options": {"num_cpus": 0.2}} | ranker,
        },
        # two ingress replicas: Serve replaces one at a time, so the proxy always has a running one
        "ingress": {
            "limits": {"request_timeout_s": DEADLINE_S},
            "retry_after_s": retry_after_s,
            "deployment": {"num_replicas": 2},
        },
    }


def history(seed: int, n: int = 20) -> list[dict]:
    rng = random.Random(seed)
    return [{"item_id": f"item-{rng.randrange(120):06d}", "action": 1, "timestamp": 1e9 + 60 * i} for i in range(n)]


def recommend_body(i: int) -> dict:
    return {"prompt": f"user {i} listened to comedy", "beam_width": 8, "history": history(i)}


def rank_body(i: int) -> dict:
    return {"history": history(i), "candidates": ["item-000001", "item-000002"]}


@dataclass
class Answer:
    route: str
    seconds: float
    status: int
    content_type: str
    retry_after: str | None
    body: dict | str


def post(base: str, route: str, body: dict) -> Answer:
    """One request, its answer and how long it took."""
    with httpx.Client(timeout=120) as client:
        started = time.monotonic()
        r = client.post(f"{base}/v1/{route}", json=body)
        seconds = time.monotonic() - started
    kind = r.headers.get("content-type", "")
    parsed = r.json() if kind.startswith("application/json") else r.text
    return Answer(route, seconds, r.status_code, kind, r.headers.get("retry-after"), parsed)


def load(base: str, stop: threading.Event, answers: list[Answer], route: str, body) -> None:
    """Requests to one route in a loop until `stop`."""
    for i in itertools.count():
        if stop.is_set():
            return
        answers.append(post(base, route, body(i)))


def replace_ingress(app: str, redeploy) -> None:
    """Run `redeploy` (a new version of the app whose ingress differs) and wait until none of the ingress replicas
    of before is left and two new ones run (the new ranker never does)."""
    before = set(replica_actor_names(app, "Ingress"))
    redeploy()
    deadline = time.monotonic() + 480  # CI's loaded 2-core machine: over 180 s once (two replicas, each drained)
    while set(replica_actor_names(app, "Ingress")) & before or deployment_states(app).get("Ingress") != {"RUNNING": 2}:
        assert time.monotonic() < deadline, deployment_states(app)
        time.sleep(0.5)


@pytest.mark.timeout(1500)  # a deploy and two replacements, each bounded (replace_ingress) on a loaded machine
def test_redeploys_replacing_the_ingress_and_its_ranker_end_every_request_in_json_by_its_deadline(
    serve_url, tiny_dir, hstu_dir
):
    """Under load: (1) a redeploy changes the ranker section (its max_candidates: the ingress is rebuilt too) and
    asks for a ranker no node can host: Serve stops the old ranker, the new one never starts; (2) a redeploy
    replaces the ingress again while both its replicas hold a burst of requests waiting on the gone ranker, with
    most of their deadline ahead (ranks: a two-stage recommend does not wait for a gone ranker). Every answer is
    genrec's JSON by the request's deadline: a 200 (degraded while the ranker is gone: the retrieval alone, at once),
    a 503 with Retry-After or a 504, never the HTTP proxy's plain-text 500 that Serve's default 20 s graceful
    shutdown caused (the replaced ingress killed under its requests)."""
    deploy("rollout", **funnel_args(tiny_dir, hstu_dir, 64, ranker_gone=False))
    base, answers, stop, ranks_stop = f"{serve_url}/rollout", [], threading.Event(), threading.Event()
    # The /v1/rank client sends no new request once the burst is out: with the ranker gone each of its requests
    # takes the whole deadline, so one sent during the second replacement ended ~26 s after the burst (the test
    # then only waited for it). Its request in flight when the burst goes out crosses the second replacement.
    routes = [(stop, "recommend", recommend_body), (stop, "recommend", recommend_body), (ranks_stop, "rank", rank_body)]
    workers = [threading.Thread(target=load, args=(base, until, answers, *route)) for until, *route in routes]
    burst = []
    try:
        for w in workers:
            w.start()
        time.sleep(2)
        gone = funnel_args(tiny_dir, hstu_dir, 65, ranker_gone=True)
        replace_ingress("rollout", lambda: deploy_started("rollout", **gone))
        with ThreadPoolExecutor(8) as pool:
            waiting = [pool.submit(post, base, "rank", rank_body(100 + i)) for i in range(8)]
            ranks_stop.set()
            time.sleep(1)
            again = funnel_args(tiny_dir, hstu_dir, 65, ranker_gone=True, retry_after_s=2)
            replace_ingress("rollout", lambda: deploy_started("rollout", **again))
            burst = [f.result() for f in waiting]
    finally:
        stop.set()
        ranks_stop.set()
        for w in workers:
            w.join()
        delete("rollout")
    every = answers + burst
    plain = [a for a in every if not a.content_type.startswith("application/json")]
    assert plain == [], plain[:3]  # the proxy's own answers (its 500 when it lost a replica mid-request)
    assert {a.status for a in every} <= {200, 503, 504}, Counter(a.status for a in every)
    assert all(a.retry_after is not None for a in every if a.status == 503)
    late = [a for a in every if a.seconds > DEADLINE_S + LATE_S]
    assert late == [], late[:3]
    # The burst was held by the replaced replicas: each /v1/rank ended at its deadline (no ranker replica came).
    assert [(a.status, a.body["code"]) for a in burst] == [(504, "timeout")] * 8
    # A two-stage recommend did not wait for the gone ranker: the retrieval alone, at once.
    gone_ranker = [a for a in answers if a.route == "recommend" and a.status == 200 and a.body["degraded"]]
    assert gone_ranker and {a.body["degraded_reason"] for a in gone_ranker} == {"ranker_unavailable"}
    assert all(DEADLINE_S - 2 < a.seconds for a in burst), [a.seconds for a in burst]
    assert any(a.route == "rank" and a.status == 504 for a in answers)  # no ranker: /v1/rank ends at the deadline
