"""The prompt forms over real HTTP (issue #30 item 5), on an auth-on app serving a tiny model with a chat template:
POST /v1/prompt shows the rendered prompt (auth like every /v1 route), /v1/retrieve and /v1/recommend take
`messages` and answer as the engine does, bad forms are a 422 naming the field, /v1/model says the model has a
chat template."""

import os

import httpx
import pytest

from genrec.api import PromptRequest, RecommendRequest, RetrieveRequest
from genrec.engine import Engine, SchedulerConfig
from genrec.model.directory import model_version
from tests.chat_model import EMPTY_THINK, write_chat_model_dir
from tests.conftest import API_TOKEN_ENV, TINY
from tests.serve_apps import delete, deploy

SYSTEM = "You recommend podcasts."
AUTH = {"Authorization": f"Bearer {os.environ[API_TOKEN_ENV]}"}
MESSAGES = [{"role": "user", "content": "user <|user|> listened to comedy podcast episode"}]
VECTOR = [0.2, -0.1, 0.4, 0.0, 0.3, -0.5]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return write_chat_model_dir(tmp_path_factory.mktemp("chat") / "model", TINY, {"system_prompt": SYSTEM})


@pytest.fixture(scope="module")
def chat_url(serve_url, chat_dir):
    ingress = {"auth_token_env": API_TOKEN_ENV, "limits": {"request_timeout_s": 30}}
    deploy("chat", retriever={"model_dir": str(chat_dir), "kv_budget_bytes": 64 << 20}, ingress=ingress)
    yield f"{serve_url}/chat"
    delete("chat")


@pytest.fixture(scope="module")
def local(chat_dir):
    return Engine.from_pretrained(chat_dir, scheduler=SchedulerConfig(prefix_cache_bytes=0))


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=60) as c:
        yield c


def test_the_prompt_endpoint_shows_what_the_engine_runs(chat_url, client, local, chat_dir):
    body = {"messages": MESSAGES, "request_id": "p-1"}
    assert client.post(f"{chat_url}/v1/prompt", json=body).status_code == 401  # auth like the other /v1 routes
    response = client.post(f"{chat_url}/v1/prompt", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    assert response.headers["x-model-version"] == model_version(chat_dir)
    got = response.json()
    assert got == local.render_prompt(PromptRequest(**body)).model_dump()
    assert got["text"].startswith(f"<|im_start|>system\n{SYSTEM}") and got["text"].endswith(EMPTY_THINK)
    as_ids = client.post(f"{chat_url}/v1/prompt", json={"prompt_token_ids": got["token_ids"]}, headers=AUTH).json()
    assert (as_ids["text"], as_ids["token_ids"], as_ids["user_placeholders"]) == (got["text"], got["token_ids"], 1)
    info = client.get(f"{chat_url}/v1/model", headers=AUTH).json()
    assert info["chat_template"] is True


def test_messages_are_served_as_the_engine_serves_them(chat_url, client, local):
    retrieve = {"messages": MESSAGES, "user_embedding": VECTOR, "beam_width": 8}
    recommend = retrieve | {"beam_width": 4, "candidates": [{"item_id": "item-000002"}], "user_id": "u-1"}
    for route, request in (("retrieve", RetrieveRequest(**retrieve)), ("recommend", RecommendRequest(**{
        k: v for k, v in recommend.items() if k != "user_id"}))):  # fmt: skip
        response = client.post(
            f"{chat_url}/v1/{route}", json=retrieve if route == "retrieve" else recommend, headers=AUTH
        )
        assert response.status_code == 200, response.text
        (want,) = getattr(local, route)([request])
        got = response.json()
        assert [i["item_id"] for i in got["items"]] == [i.item_id for i in want.items]
        key = "logprob" if route == "retrieve" else "score_logprob"
        assert [i[key] for i in got["items"]] == pytest.approx([getattr(i, key) for i in want.items], abs=1e-5)
        assert got["prompt_tokens"] == want.prompt_tokens


@pytest.mark.parametrize(
    "route, body, field",
    [
        ("prompt", {"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ("retrieve", {"messages": [{"role": "robot", "content": "x"}], "beam_width": 2}, "messages"),
        ("prompt", {"messages": [{"role": "user", "content": "a", "extra": 1}]}, "messages[0].extra"),
        ("retrieve", {"messages": [{"role": "user"}]}, "messages[0].content"),
        ("prompt", {"prompt_token_ids": [10**6]}, "prompt_token_ids"),
        ("prompt", {"prompt": "a", "beam_width": 3}, "beam_width"),
    ],
)
def test_bad_prompt_forms_are_a_422_naming_the_field(chat_url, client, route, body, field):
    response = client.post(f"{chat_url}/v1/{route}", json=body, headers=AUTH)
    assert response.status_code == 422, response.text
    got = response.json()
    assert got["code"] == "invalid_request" and got["details"][0]["field"] == field, got


def test_two_prompt_forms_are_a_422_that_names_them(chat_url, client):
    body = {"prompt": "a", "messages": MESSAGES}
    response = client.post(
        f"{chat_url}/v1/score", json=body | {"candidates": [{"item_id": "item-000001"}]}, headers=AUTH
    )
    assert response.status_code == 422
    assert "'prompt' and 'messages' were given" in response.json()["message"]


def test_a_chat_without_a_user_routes_by_its_opening():
    from genrec.serving.router import routing_key
    from genrec.serving.schemas import RetrieveBody

    def key(*contents: str, **fields) -> str:
        return routing_key(RetrieveBody(messages=[{"role": "user", "content": c} for c in contents], **fields))

    history = "user listened to comedy podcast episode " * 3  # past the first block's characters
    assert key(history + "news") == key(history + "sports", "recommend next")  # a returning user's longer chat
    assert key(history) != key("another user's history " + history)
    assert key(history) != routing_key(RetrieveBody(prompt=history))  # a chat and a text: two kinds of key
    assert key(history, user_id="u-1") == routing_key(RetrieveBody(prompt="a", user_id="u-1"))  # the user first
