"""Validation errors in genrec's JSON shape, each naming its field in genrec's words (no Ray: the request models and
the formatting function directly, and a bare FastAPI app with the handler)."""

import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from pydantic import BaseModel, ValidationError

from genrec.api import RecommendRequest, RetrieveRequest, ScoreRequest
from genrec.serving.http_errors import _invalid, validation_error_handler


class Body(BaseModel):
    beam_width: int


def post(content: bytes):
    app = FastAPI()
    app.add_exception_handler(RequestValidationError, validation_error_handler)

    @app.post("/v1/retrieve")
    def retrieve(body: Body):
        return {}

    return TestClient(app).post("/v1/retrieve", content=content, headers={"content-type": "application/json"})


def test_malformed_json_is_400_naming_the_body_and_the_position():
    response = post(b'{"beam_width": ')
    assert response.status_code == 400
    (detail,) = response.json()["details"]
    assert detail == {"field": "body", "message": "malformed JSON at character 15: Expecting value"}


def test_a_bad_field_is_422_naming_it():
    response = post(b'{"beam_width": "wide"}')
    assert response.status_code == 422
    assert [d["field"] for d in response.json()["details"]] == ["beam_width"]


# Each model-level or type error as the 422 names it: (request kind, body, field, the message's genrec words)
LOCATED = [
    ("retrieve", {"prompt": "x", "beam_width": 4, "beam_widths": [2, 8]}, "beam_width", "4 differs from the last of"),
    ("retrieve", {"prompt": "x", "beam_width": 4, "num_results": 9}, "num_results", "9 is above beam_width (4)"),
    ("recommend", {"prompt": "x", "beam_width": 4, "num_results": 9}, "num_results", "9 is above beam_width (4)"),
    ("retrieve", {"prompt": "x", "filters": {"": 1, "year": 1995}}, "filters", "key '': must not be empty"),
    ("retrieve", {"prompt": "x", "beam_widths": []}, "beam_widths", "must not be empty"),
    ("retrieve", {"prompt": "x", "beam_widths": [4, 0]}, "beam_widths[1]", "must be at least 1"),
    ("retrieve", {"prompt": "x", "beam_width": "3"}, "beam_width", "must be an integer"),
    ("retrieve", {"prompt": "x", "beam_widht": 3}, "beam_widht", "is not a field of this request"),
    ("retrieve", {"prompt": "x", "request_id": "r" * 300}, "request_id", "must have at most 256 characters"),
    ("retrieve", {}, "prompt", "give exactly one of 'prompt'"),
    ("retrieve", {"prompt": "x", "messages": []}, "prompt", "'prompt' and 'messages' were given"),
    ("retrieve", {"prompt": " "}, "prompt", "'prompt' is empty"),
    ("retrieve", {"prompt": "x", "filters": {"year": {"after": 1}}}, "filters.year", "a range takes gte, gt, lte"),
    ("score", {"prompt": "x", "candidates": [{"text": "a", "item_id": "b"}]}, "candidates[0].text", "exactly one"),
    ("score", {"prompt": "x"}, "candidates", "is required"),
    ("recommend", {"prompt": "x", "score_weight": 2.0}, "score_weight", "applies to rank_by 'joint' only"),
    ("recommend", {"prompt": "x", "rank_by": "best"}, "rank_by", "must be 'score', 'joint' or 'beam'"),
    ("score", {"prompt": "x", "candidates": [{"text": "a"}], "labels": ["yes"]}, "labels", "needs 2 labels"),
    ("recommend", {"prompt": "x", "labels": ["a", "b", "c"]}, "labels", "needs 2 labels, the positive then the"),
    ("score", {"prompt": "x", "candidates": [{"text": "a"}], "labels": ["yes", 1]}, "labels[1]", "must be text"),
    (
        "recommend",
        {"prompt": "x", "rank_by": "beam", "candidates": [{"item_id": "a"}, {"text": "b"}]},
        "candidates[1]",
        "give candidates as item_id",
    ),
]
PYDANTIC_WORDS = ("Value error", "Input should", "after validation", "Extra inputs", "Field required", "should have")


@pytest.mark.parametrize(("kind", "body", "field", "words"), LOCATED, ids=[str(i) for i in range(len(LOCATED))])
def test_every_422_names_its_field_in_genrecs_words(kind, body, field, words):
    model = {"retrieve": RetrieveRequest, "score": ScoreRequest, "recommend": RecommendRequest}[kind]
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    got = _invalid(info.value.errors())
    (detail,) = got.details
    assert detail.field == field and words in detail.message, detail
    assert got.message == f"{field}: {detail.message}"
    assert not [w for w in PYDANTIC_WORDS if w in got.message], got.message


def test_a_model_level_refusal_over_http_is_422_at_its_field():
    """The handler FastAPI calls with the real request model: the field is located, not null."""
    app = FastAPI()
    app.add_exception_handler(RequestValidationError, validation_error_handler)

    @app.post("/v1/retrieve")
    def retrieve(body: RetrieveRequest):
        return {}

    response = TestClient(app).post("/v1/retrieve", json={"prompt": "x", "beam_width": 4, "beam_widths": [2, 8]})
    assert response.status_code == 422
    assert response.json()["details"] == [
        {"field": "beam_width", "message": "4 differs from the last of beam_widths (8): give one, or the same"}
    ]


# A null or a value of another type where a list item or an object is expected (issue #46, item 6: these read as
# pydantic's "Input should be a valid dictionary or instance of Candidate", "Field required"): (route, body, the
# one detail's field, its message)
NULLS = [
    ("score", {"prompt": "x", "candidates": [{"text": "a"}, None]}, "candidates[1]",
     "must be an object with item_id, text or token_ids; got null"),
    ("score", {"prompt": "x", "candidates": [{"text": "a"}, "b"]}, "candidates[1]",
     "must be an object with item_id, text or token_ids; got a string"),
    ("score", {"prompt": "x", "candidates": None}, "candidates",
     "must be a list of objects with item_id, text or token_ids; got null"),
    ("rank", {"history": None, "candidates": ["a"]}, "history", "must be a list of events; got null"),
    ("rank", {"history": {"item_id": "a"}, "candidates": ["a"]}, "history", "must be a list of events; got an object"),
    ("rank", {"candidates": ["a"]}, "history", "is required"),
    ("rank", {"history": [None], "candidates": ["a"]}, "history[0]",
     "must be an object with item_id (and action, timestamp); got null"),
    ("rank", {"history": [{"item_id": None}], "candidates": ["a"]}, "history[0].item_id",
     "must be text (a string); got null"),
    ("rank", {"history": [{"item_id": "a"}], "candidates": ["a", None]}, "candidates[1]",
     "must be text (a string); got null"),
    ("rank", {"history": [{"item_id": "a", "action": "1"}], "candidates": ["a"]}, "history[0].action",
     "must be an integer; got a string"),
    ("recommend", {"prompt": "x", "history": [None]}, "history[0]",
     "must be an object with item_id (and action, timestamp); got null"),
    ("retrieve", {"messages": [None]}, "messages[0]", "must be an object with role and content; got null"),
    ("retrieve", {"prompt": "x", "beam_width": None}, "beam_width", "must be an integer; got null"),
    ("retrieve", {"prompt": "x", "filters": {"year": None}}, "filters.year",
     "must be text, a finite number or true/false, not null"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "body", "field", "message"), NULLS, ids=[str(i) for i in range(len(NULLS))])
def test_a_null_or_wrong_type_is_told_in_genrecs_words_over_http(route, body, field, message):
    """The ingress's own request models behind genrec's handlers (edge.install), as JSON over HTTP."""
    from genrec.serving import edge
    from genrec.serving.schemas import RankBody, RecommendBody, RetrieveBody, ScoreBody

    app = FastAPI()
    edge.install(app, edge.EdgeSettings())
    model = {"retrieve": RetrieveBody, "score": ScoreBody, "recommend": RecommendBody, "rank": RankBody}[route]

    @app.post(f"/v1/{route}")
    def answer(request: model):  # noqa: ARG001 - FastAPI validates the body by the annotation
        return {}

    response = TestClient(app).post(f"/v1/{route}", json=body)
    assert response.status_code == 422
    assert response.json()["details"] == [{"field": field, "message": message}]
    assert response.json()["message"] == f"{field}: {message}"
    assert not [w for w in PYDANTIC_WORDS if w in response.text], response.text
