"""Every 400 and 422 names where the problem is, over real HTTP on an app that serves every route (a Qwen3 retriever
and an HSTU ranker): a body that is not a JSON object is named `body` and told what it was, malformed bodies on
each route never answer a null field, and an item given twice is refused by score and rank at its second place
(recommend, whose answer has one row per item, keeps it once)."""

import json

import httpx
import pytest

from tests.serve_apps import delete, deploy

ROUTES = ("retrieve", "score", "recommend", "rank", "prompt")
JSON = {"content-type": "application/json"}
PROMPT = "user listened to comedy podcast episode"


def item(i: int) -> str:
    """An item of both models' catalogs (the tiny retriever's 300, the tiny ranker's 120)."""
    return f"item-{i:06d}"


@pytest.fixture(scope="module")
def url(serve_url, tiny_dir, hstu_dir):
    deploy(
        "bodies",
        retriever={"model_dir": str(tiny_dir), "threads": 1},
        ranker={"model_dir": str(hstu_dir), "kv_budget_bytes": 32 << 20},
        ingress={"limits": {"request_timeout_s": 20}},
    )
    yield f"{serve_url}/bodies"
    delete("bodies")


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=60) as c:
        yield c


# A body that is not a JSON object, the same on every route: (body, headers, status, what the message says it was)
NOT_AN_OBJECT = [
    (b"", JSON, 422, "must be a JSON object of the request's fields; got an empty body"),
    (b"null", JSON, 422, "must be a JSON object of the request's fields; got null"),
    (b'[{"prompt": "x"}]', JSON, 422, "must be a JSON object of the request's fields; got an array"),
    (b'"x"', JSON, 422, "must be a JSON object of the request's fields; got a string"),
    (b"7", JSON, 422, "must be a JSON object of the request's fields; got a number"),
    (b"true", JSON, 422, "must be a JSON object of the request's fields; got true or false"),
    (b'{"prompt": ', JSON, 400, "malformed JSON at character 11: Expecting value"),
    (b'{"prompt": "\xff"}', JSON, 400, "is not JSON text: send a JSON object, UTF-8 encoded"),
    (
        b'{"prompt": "x"}',
        {"content-type": "application/x-www-form-urlencoded"},  # curl -d without -H
        422,
        "must be a JSON object, sent with Content-Type 'application/json'; got Content-Type "
        "'application/x-www-form-urlencoded'",
    ),
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("body", "headers", "status", "message"), NOT_AN_OBJECT)
def test_a_body_that_is_not_a_json_object_is_named_body(url, client, route, body, headers, status, message):
    response = client.post(f"{url}/v1/{route}", content=body, headers=headers)
    assert response.status_code == status, response.text
    assert response.json() == {
        "code": "invalid_request",
        "message": f"body: {message}",
        "details": [{"field": "body", "message": message}],
    }


# Malformed objects, sent to every route (a field one route takes is unknown to another): refused by the edge's
# validation, by the ingress or by the engine, each answer names its fields.
MALFORMED = [
    {},
    {"no_such_field": 1},
    {"prompt": 7, "candidates": "a", "history": {}},
    {"prompt": PROMPT, "candidates": [{"item_id": "no-such-item"}]},  # the retriever's 422
    {"prompt": PROMPT, "history": [{"item_id": "no-such-item"}]},  # two stages: the ranker refuses the history
    {"prompt": PROMPT, "candidates": [{"item_id": item(1)}], "labels": ["yes"]},
    {"prompt": PROMPT, "rank_task": "click", "request_id": ["r"]},
    {"prompt": PROMPT, "history": [{"item_id": item(1)}], "labels": ["yes", "no"]},  # two stages take no label
    {"history": [{"item_id": item(1)}], "candidates": [item(2), "missing"]},  # the ranker's 422
    {"history": [{"item_id": item(1)}], "candidates": [item(2), item(2)]},
    {"prompt": PROMPT, "candidates": [{"item_id": item(2)}, {"item_id": item(2)}], "rank_by": "beam", "labels": []},
]
CASES = [(route, json.dumps(body).encode(), JSON) for route in ROUTES for body in MALFORMED]
CASES += [(route, body, headers) for route in ROUTES for body, headers, *_ in NOT_AN_OBJECT]


@pytest.mark.parametrize(("route", "body", "headers"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_every_400_and_422_names_a_field(url, client, route, body, headers):
    response = client.post(f"{url}/v1/{route}", content=body, headers=headers)
    assert response.status_code in (400, 422), response.text
    error = response.json()
    assert error["code"] == "invalid_request" and error["details"], error
    assert all(isinstance(d["field"], str) and d["field"] for d in error["details"]), error
    assert error["message"] == "; ".join(f"{d['field']}: {d['message']}" for d in error["details"])


def test_labels_of_another_count_name_labels(url, client):
    body = {"prompt": PROMPT, "candidates": [{"item_id": item(1)}], "labels": ["yes"]}
    response = client.post(f"{url}/v1/score", json=body)
    assert response.status_code == 422
    assert response.json()["details"] == [
        {"field": "labels", "message": "needs 2 labels, the positive then the negative; got 1"}
    ]


@pytest.mark.parametrize(
    ("route", "body", "field", "message"),
    [
        (
            "rank",
            {"history": [{"item_id": item(1)}], "candidates": [item(2), item(3), item(2)]},
            "candidates[2]",
            "repeats candidates[0] (item 'item-000002'): give each item once",
        ),
        (
            "score",
            {
                "prompt": PROMPT,
                "candidates": [{"item_id": item(2)}, {"text": "a"}, {"text": "a"}, {"item_id": item(2)}],
            },
            "candidates[3]",
            "repeats candidates[0] (item 'item-000002'): give each item once",
        ),
    ],
)
def test_score_and_rank_refuse_an_item_given_twice(url, client, route, body, field, message):
    response = client.post(f"{url}/v1/{route}", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["details"] == [{"field": field, "message": message}]


def test_score_scores_repeated_text_each_time(url, client):
    """Text and token candidates are no item: each is a row of the answer, repeated or not."""
    body = {"prompt": PROMPT, "candidates": [{"text": "a science show"}, {"text": "a science show"}]}
    response = client.post(f"{url}/v1/score", json=body)
    assert response.status_code == 200, response.text
    first, second = response.json()["scores"]
    assert first["logprob"] == pytest.approx(second["logprob"], abs=1e-5)


def test_recommend_keeps_an_item_given_twice_once(url, client):
    """Its answer has one row per item (an item retrieved and given is one row too): a repeat is merged."""
    body = {"prompt": PROMPT, "beam_width": 4, "candidates": [{"item_id": item(5)}, {"item_id": item(5)}]}
    response = client.post(f"{url}/v1/recommend", json=body)
    assert response.status_code == 200, response.text
    items = [i["item_id"] for i in response.json()["items"]]
    assert items.count(item(5)) == 1 and len(items) == len(set(items)), items
