"""POST /v1/rank over real HTTP on an app serving a tiny HSTU model: equal to Engine.rank, bad input a 4xx naming
the field, /v1/model describing the ranker, and the Qwen3 routes refused with a clear 404 (never a 5xx)."""

import json
import random

import httpx
import pytest

from genrec.api import Event, RankRequest
from genrec.model.directory import model_version
from tests.conftest import HSTU_TINY as SPEC
from tests.serve_apps import delete, deploy


@pytest.fixture(scope="module")
def rank_url(serve_url, hstu_dir):
    ranker = {"model_dir": str(hstu_dir), "kv_budget_bytes": 32 << 20}
    deploy("ranker", ranker=ranker, ingress={"limits": {"request_timeout_s": 20}})
    yield f"{serve_url}/ranker"
    delete("ranker")


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=60) as c:
        yield c


def item(i: int) -> str:
    return f"item-{i % SPEC.items:06d}"


def history(rng: random.Random, n: int) -> list[Event]:
    t, events = 1e9, []
    for _ in range(n):
        t += rng.choice([5.0, 300.0, 86400.0])
        events.append(Event(item_id=item(rng.randrange(SPEC.items)), action=rng.choice([None, 0, 1, 2]), timestamp=t))
    return events


def test_rank_equals_the_engine(rank_url, client, ranker, hstu_dir):
    rng = random.Random(1)
    events = history(rng, 40)
    requests = [
        RankRequest(history=events[:30], candidates=[item(i) for i in (3, 17, 40, 90)]),
        RankRequest(history=events, candidates=[item(i) for i in range(20)], tasks=["like", "click"]),
        RankRequest(history=history(rng, 1), candidates=[item(5)], request_id="r-1"),
    ]
    for user, request in zip(("u-1", "u-1", None), requests, strict=True):  # u-1 returns with 10 more events
        body = request.model_dump(exclude_none=True) | ({"user_id": user} if user else {})
        response = client.post(f"{rank_url}/v1/rank", json=body)
        assert response.status_code == 200, response.text
        assert response.headers["x-model-version"] == model_version(hstu_dir)
        (want,) = ranker.rank([request])
        got = response.json()
        assert (got["request_id"], got["history_events"]) == (want.request_id, want.history_events)
        assert [i["item_id"] for i in got["items"]] == request.candidates
        for got_item, want_item in zip(got["items"], want.items, strict=True):
            assert list(got_item["scores"]) == list(want_item.scores)
            assert got_item["scores"] == pytest.approx(want_item.scores, abs=1e-5)


def test_model_info_describes_the_ranker(rank_url, client, hstu_dir):
    info = client.get(f"{rank_url}/v1/model").json()
    assert info["version"] == model_version(hstu_dir)
    assert (info["family"], info["serves"], info["tasks"]) == ("hstu", ["rank"], list(SPEC.tasks))
    assert (info["catalog_items"], info["max_history_events"]) == (SPEC.items, SPEC.max_positions - 1)
    assert info["levels"] is info["max_beam_width"] is info["user_dim"] is None
    assert "/v1/rank" in client.get(f"{rank_url}/openapi.json").json()["paths"]


# Two finite times whose gap is not: 1.7e308 - (-1.7e308) overflows a float.
FAR = [{"item_id": item(1), "timestamp": -1.7e308}, {"item_id": item(2), "timestamp": 1.7e308}]
GOOD = {"history": [{"item_id": item(1), "action": 0, "timestamp": 1e9}, {"item_id": item(2)}], "candidates": [item(3)]}
BAD = [
    ({**GOOD, "history": [{"item_id": item(1)}, {"item_id": "no-such-item"}]}, "history[1].item_id"),
    ({**GOOD, "candidates": [item(3), "missing"]}, "candidates[1]"),
    ({**GOOD, "history": [{"item_id": item(1), "action": SPEC.actions}]}, "history[0].action"),
    ({**GOOD, "history": [{"item_id": item(1), "action": -1}]}, "history[0].action"),
    ({**GOOD, "history": [{"item_id": item(1), "timestamp": "noon"}]}, "history[0].timestamp"),
    ({**GOOD, "history": [{"item_id": item(1), "timestamp": 10**400}]}, "history[0].timestamp"),  # beyond a float
    ({**GOOD, "history": FAR}, "history[0].timestamp"),
    ({**GOOD, "tasks": ["purchase"]}, "tasks"),
    ({**GOOD, "candidates": []}, "candidates"),
    ({**GOOD, "history": []}, "history"),
    ({**GOOD, "histroy": []}, "histroy"),
    ({**GOOD, "user_id": ["u"]}, "user_id"),
    ({**GOOD, "history": [{"item_id": item(i)} for i in range(SPEC.max_positions)]}, "history"),
    ({"candidates": [item(3)]}, "history"),
]


@pytest.mark.parametrize(("body", "field"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_rank_requests_are_422_naming_the_field(rank_url, client, body, field):
    headers = {"content-type": "application/json"}
    response = client.post(f"{rank_url}/v1/rank", content=json.dumps(body), headers=headers)
    assert response.status_code == 422, response.text[:2000]
    error = response.json()
    assert error["code"] == "invalid_request" and field in response.text


@pytest.mark.parametrize("route", ["retrieve", "score", "recommend", "prompt"])
def test_the_qwen3_routes_are_a_clear_404_on_a_ranker(rank_url, client, route):
    body = {"prompt": "user listened"}
    if route != "prompt":  # a prompt body has no user; no embedding lookup either: the ranker takes none
        body["user_id"] = "u-1"
    if route == "score":
        body["candidates"] = [{"item_id": item(3)}]
    response = client.post(f"{rank_url}/v1/{route}", json=body)
    assert response.status_code == 404, response.text
    error = response.json()
    assert error["code"] == "not_served"
    assert "hstu" in error["message"] and "/v1/rank" in error["message"] and f"/v1/{route}" in error["message"]


def test_rank_requests_are_counted_by_kind(rank_url, client):
    from ray import serve

    assert client.post(f"{rank_url}/v1/rank", json=GOOD).status_code == 200
    stats = serve.get_deployment_handle("RankerServer", app_name="ranker").stats.remote().result(timeout_s=30)
    assert stats["metrics"]["requests"]["rank:ok"] >= 1
