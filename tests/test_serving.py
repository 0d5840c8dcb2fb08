"""The Serve app over real HTTP: routes, auth, bad input, overload, deadlines, replica loss, rollout."""

import itertools
import json
import os
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from genrec.api import Candidate, RecommendRequest, RetrieveRequest, ScoreRequest
from genrec.model.directory import model_version
from genrec.testing.tiny import write_model_dir
from tests.conftest import API_TOKEN_ENV, TINY
from tests.serve_apps import (
    delete,
    deploy,
    deploy_many,
    deploy_refused,
    deployment_states,
    replica_actor_names,
    wait_for,
)

PROMPT = "user <|user|> listened to comedy podcast episode then news daily"


def user_vector(seed: int) -> list[float]:
    return np.random.default_rng(seed).normal(size=TINY.user_dim).round(4).tolist()


@pytest.fixture(scope="module")
def cache_args(tmp_path_factory):
    return {
        "name": "serve-test-users",
        "dim": TINY.user_dim,
        "store": "sqlite",
        "store_path": str(tmp_path_factory.mktemp("cache") / "users.sqlite"),
    }


@pytest.fixture(scope="module")
def open_url(serve_url, tiny_dir, cache_args):
    from genrec.cache.actor import EmbeddingCache
    from genrec.cache.config import CacheConfig

    EmbeddingCache.connect(CacheConfig(**cache_args)).put(["u-1", "u-2"], [user_vector(1), user_vector(2)])
    deploy(
        "open",
        retriever={"model_dir": str(tiny_dir)},
        ingress={"cache": cache_args, "limits": {"request_timeout_s": 20}},
    )
    yield f"{serve_url}/open"
    delete("open")


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=60) as c:
        yield c


def raw_post(app_url: str, path: str, headers, parts, timeout_s: float = 30) -> tuple[int, str, float]:
    """A POST over a plain socket, its body `parts` sent as they come (a client that streams or trickles its
    body); sending stops once an answer arrives. `headers`: a dict, or (name, value) pairs (a name may repeat, as
    no HTTP client library sends it). Returns (status, the error code, seconds until the answer)."""
    import select

    host, port, prefix = app_url.split("//")[1].replace(":", "/", 1).split("/", 2)
    pairs = headers.items() if isinstance(headers, dict) else headers
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        lines = [f"POST /{prefix}{path} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in pairs)]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        try:
            for part in parts:
                if select.select([sock], [], [], 0)[0]:
                    break  # answered before the body was all sent
                sock.sendall(part)
        except OSError:
            pass  # the server closed the connection: its answer is read below
        answer = b""
        while b"}" not in answer and (more := sock.recv(4096)):
            answer += more
    code = json.loads(answer[answer.index(b"{") :]).get("code")
    return int(answer.split(b" ", 2)[1]), code, time.monotonic() - started


def under_load(url: str, during, headers=None, threads: int = 2) -> tuple[list, list]:
    """Requests in a loop from `threads` clients while `during()` runs: (model versions answered, failures)."""
    seen, failures, stop = [], [], threading.Event()

    def load():
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                r = c.post(url, json={"prompt": "user listened", "beam_width": 8}, headers=headers)
                (seen if r.status_code == 200 else failures).append(r.headers.get("x-model-version", r.text))

    workers = [threading.Thread(target=load) for _ in range(threads)]
    for w in workers:
        w.start()
    try:
        time.sleep(1)
        during()
    finally:
        stop.set()
        for w in workers:
            w.join()
    return seen, failures


# -- routes ---------------------------------------------------------------------------------------


def test_retrieve_score_recommend_equal_the_engine(open_url, client, engine, tiny_dir):
    vector = user_vector(1)
    candidates = [Candidate(item_id=engine.catalog.item_ids[i]) for i in (3, 30)] + [Candidate(text="a science show")]
    cases = [
        (
            "retrieve",
            RetrieveRequest(prompt=PROMPT, user_embedding=vector, beam_width=16, num_results=8),
            engine.retrieve,
        ),
        ("score", ScoreRequest(prompt=PROMPT, user_embedding=vector, candidates=candidates), engine.score),
        (
            "recommend",
            RecommendRequest(prompt=PROMPT, user_embedding=vector, beam_width=8, candidates=candidates[2:]),
            engine.recommend,
        ),
        (
            "recommend",
            RecommendRequest(
                prompt=PROMPT,
                user_embedding=vector,
                beam_width=8,
                candidates=candidates[:2],
                rank_by="joint",
                score_weight=0.5,
            ),
            engine.recommend,
        ),
    ]
    for route, request, direct in cases:
        response = client.post(f"{open_url}/v1/{route}", json=request.model_dump(exclude_none=True))
        assert response.status_code == 200, response.text
        assert response.headers["x-model-version"] == model_version(tiny_dir)
        (want,) = direct([request])
        got = response.json()
        if route == "score":
            assert [s["logprob"] for s in got["scores"]] == pytest.approx([s.logprob for s in want.scores], abs=1e-4)
        else:
            assert [i["item_id"] for i in got["items"]] == [i.item_id for i in want.items]
            for key in ("logprob",) if route == "retrieve" else ("score_logprob", "code_logprob"):
                assert [i[key] for i in got["items"]] == pytest.approx([getattr(i, key) for i in want.items], abs=1e-4)


def test_model_info_health_and_docs(open_url, client, tiny_dir):
    info = client.get(f"{open_url}/v1/model").json()
    assert info["version"] == model_version(tiny_dir)
    assert (info["catalog_items"], info["levels"], info["user_dim"]) == (TINY.items, TINY.levels, TINY.user_dim)
    assert info["max_beam_width"] >= 256 and info["max_candidates"] > 0
    health = client.get(f"{open_url}/healthz")
    assert health.status_code == 200 and health.json()["model_version"] == info["version"]
    assert client.get(f"{open_url}/docs").status_code == 200
    paths = client.get(f"{open_url}/openapi.json").json()["paths"]
    assert {"/v1/retrieve", "/v1/score", "/v1/recommend", "/v1/model", "/healthz"} <= set(paths)


def test_user_id_is_resolved_through_the_cache(open_url, client):
    by_id = client.post(f"{open_url}/v1/retrieve", json={"prompt": PROMPT, "user_id": "u-2", "beam_width": 8})
    inline = client.post(
        f"{open_url}/v1/retrieve", json={"prompt": PROMPT, "user_embedding": user_vector(2), "beam_width": 8}
    )
    assert by_id.status_code == inline.status_code == 200
    assert by_id.json()["items"] == inline.json()["items"]
    other = client.post(f"{open_url}/v1/retrieve", json={"prompt": PROMPT, "user_id": "u-1", "beam_width": 8})
    assert other.json()["items"] != by_id.json()["items"]
    wins = client.post(
        f"{open_url}/v1/retrieve",
        json={"prompt": PROMPT, "user_id": "u-1", "user_embedding": user_vector(2), "beam_width": 8},
    )
    assert wins.json()["items"] == inline.json()["items"]  # an inline vector wins over the stored one
    missing = client.post(f"{open_url}/v1/retrieve", json={"prompt": PROMPT, "user_id": "nobody", "beam_width": 8})
    assert missing.status_code == 404
    assert "nobody" in missing.json()["message"] and missing.json()["details"][0]["field"] == "user_id"


def test_rank_is_a_clear_404_on_a_qwen3_model(open_url, client):
    body = {"history": [{"item_id": "item-000001"}], "candidates": ["item-000002"], "user_id": "u-1"}
    response = client.post(f"{open_url}/v1/rank", json=body)
    assert response.status_code == 404 and response.json()["code"] == "not_served", response.text
    assert "qwen3" in response.json()["message"] and "/v1/retrieve" in response.json()["message"]
    info = client.get(f"{open_url}/v1/model").json()
    assert (info["family"], info["serves"], info["tasks"]) == ("qwen3", ["retrieve", "score", "recommend"], None)


# -- bad input: 4xx naming the field, never a 5xx -------------------------------------------------

BAD = [
    ("retrieve", b'{"prompt": "x", "beam_width": ', 400, None),
    ("retrieve", b"[1, 2]", 422, None),
    ("retrieve", {"prompt": "user listened", "beam_widht": 4}, 422, "beam_widht"),
    ("retrieve", {"prompt": "user listened", "beam_width": "wide"}, 422, "beam_width"),
    ("retrieve", {"prompt": "user listened", "beam_width": True}, 422, "beam_width"),
    ("retrieve", {"prompt": "user listened", "beam_width": 0}, 422, "beam_width"),
    ("retrieve", {"prompt": "user listened", "beam_width": 100000}, 422, "beam_width"),
    ("retrieve", {"prompt_token_ids": [1] * 9000}, 422, "prompt_token_ids"),
    ("retrieve", {"prompt_token_ids": [10**9]}, 422, "prompt_token_ids"),
    ("retrieve", {"prompt": PROMPT, "user_embedding": [0.5] * (TINY.user_dim + 1)}, 422, "user_embedding"),
    ("retrieve", {"prompt": PROMPT, "user_embedding": [float("nan")] * TINY.user_dim}, 422, "user_embedding"),
    ("retrieve", {"prompt": PROMPT, "user_embedding": [1e39] * TINY.user_dim}, 422, "user_embedding"),
    ("retrieve", {"prompt": "user listened", "user_id": ["a"]}, 422, "user_id"),
    ("retrieve", {"prompt": "user listened", "user_id": 10**30}, 422, "user_id"),
    ("retrieve", b'{"prompt": "user listened", "user_id": "\\ud800"}', 422, "user_id"),
    ("retrieve", {"prompt": "user listened", "user_id": "u" * 300}, 422, "user_id"),
    ("retrieve", {"prompt": "user listened", "user_id": 1.5}, 422, "user_id"),
    ("retrieve", {"prompt": "user listened", "user_id": True}, 422, "user_id"),
    ("retrieve", {"prompt": "user listened", "user_id": -(2**63)}, 422, "user_id"),
    ("retrieve", {"prompt": "word " * 2_000_000}, 422, "prompt"),
    ("score", {"prompt": "user listened", "candidates": [{"text": "news " * 2_000_000}]}, 422, "candidates[0].text"),
    ("retrieve", {}, 422, "prompt"),
    ("score", {"prompt": "user listened", "candidates": [{"item_id": "no-such-item"}]}, 422, "candidates[0].item_id"),
    ("score", {"prompt": "user listened", "candidates": []}, 422, "candidates"),
    ("score", {"prompt": "user listened", "candidates": [{"text": "x"}] * 5000}, 422, "candidates"),
    ("score", {"prompt": "user listened", "candidates": [{"item_id": 7}]}, 422, "candidates[0].item_id"),
    ("score", {"prompt": "user listened", "candidates": [{"text": "x"}], "labels": ["yes"]}, 422, "labels"),
    ("recommend", {"prompt": "user listened", "beam_width": 4, "num_results": 9}, 422, "num_results"),
    ("retrieve", {"prompt": "user listened", "beam_width": 4, "beam_widths": [2, 2, 8]}, 422, "beam_width"),
    ("retrieve", {"prompt": "user listened", "filters": {"": 1, "year": 1995}}, 422, "filters"),
    ("recommend", {"prompt": "user listened", "rank_by": "retrieval"}, 422, "rank_by"),
    ("recommend", {"prompt": "user listened", "rank_by": "joint", "score_weight": -1}, 422, "score_weight"),
    ("retrieve", {"prompt": "user listened", "filters": {"genre": "comedy"}}, 422, "filters.genre"),  # no attribute
    ("recommend", {"prompt": "user listened", "filters": {"year": {"gte": 1, "after": 2}}}, 422, "filters.year"),
    (
        "score",
        {"prompt": "user listened", "candidates": [{"item_id": "item-000001"}], "allowed_item_ids": ["no"]},
        422,
        "allowed_item_ids[0]",
    ),
]


def test_a_body_over_the_limit_is_413_before_it_is_read(open_url, client):
    from genrec.serving.edge import MAX_BODY_BYTES

    response = client.post(
        f"{open_url}/v1/retrieve", content=b" " * (MAX_BODY_BYTES + 1), headers={"content-type": "application/json"}
    )
    assert response.status_code == 413 and response.json()["code"] == "too_large"


def test_a_chunked_body_over_the_limit_is_413(open_url):
    """No Content-Length: the ingress counts the body as it arrives and refuses it past 32 MiB (40 MiB sent)."""
    chunk = b" " * (1 << 20)
    head = {"Content-Type": "application/json", "Transfer-Encoding": "chunked"}
    chunks = itertools.chain((b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(40)), [b"0\r\n\r\n"])
    assert raw_post(open_url, "/v1/retrieve", head, chunks)[:2] == (413, "too_large")


@pytest.mark.parametrize(("route", "body", "status", "field"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_a_4xx_naming_the_field(open_url, client, route, body, status, field):
    url = f"{open_url}/v1/{route}"
    if isinstance(body, bytes):
        response = client.post(url, content=body, headers={"content-type": "application/json"})
    else:  # json.dumps writes NaN / 1e39 literally, as a careless client would
        response = client.post(url, content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code == status, response.text[:2000]
    error = response.json()
    assert error["code"] == "invalid_request" and error["message"]
    if field is not None:
        assert field in response.text
    if status == 422 and isinstance(body, dict) and field in ("beam_width", "num_results", "filters"):
        assert field in [d["field"] for d in error["details"]], error  # located, even a check across fields
    assert not [word for word in ("function", "0x", "functools", "constrained-") if word in response.text]


def test_the_service_is_healthy_after_the_bad_input(open_url, client):
    """Bad input never replaces a replica: every body of BAD sent, the same replicas answer."""
    replicas = replica_actor_names("open", "Ingress") + replica_actor_names("open", "EngineServer")
    for route, body, status, _ in BAD:
        content = body if isinstance(body, bytes) else json.dumps(body)
        headers = {"content-type": "application/json"}
        assert client.post(f"{open_url}/v1/{route}", content=content, headers=headers).status_code == status
    assert client.get(f"{open_url}/healthz").status_code == 200
    assert client.head(f"{open_url}/healthz").status_code == 200  # load balancers probe with HEAD too
    assert replica_actor_names("open", "Ingress") + replica_actor_names("open", "EngineServer") == replicas
    ok = client.post(f"{open_url}/v1/retrieve", json={"prompt": "user listened", "beam_width": 4})
    assert ok.status_code == 200 and len(ok.json()["items"]) == 4


# -- auth, deadlines and live reconfiguration, rollout: one auth-on app ---------------------------

AUTH = {"Authorization": f"Bearer {os.environ[API_TOKEN_ENV]}"}
GUARDED = {"auth_token_env": API_TOKEN_ENV, "limits": {"request_timeout_s": 20}, "body_timeout_s": 2}


def guarded_args(model_dir) -> dict:
    return {"retriever": {"model_dir": str(model_dir)}, "ingress": GUARDED}


@pytest.fixture(scope="module")
def guarded_app(serve_url, tiny_dir):
    deploy("guarded", **guarded_args(tiny_dir))
    yield f"{serve_url}/guarded"
    delete("guarded")


@pytest.fixture
def guarded_url(guarded_app, tiny_dir):
    """The auth-on app as every test here expects it, whatever an earlier test redeployed (a config equal to the
    running one changes nothing; after a rollout to another model, this rolls it back)."""
    deploy("guarded", **guarded_args(tiny_dir))
    return guarded_app


def test_bearer_token_when_configured(guarded_url, client):
    url, body = f"{guarded_url}/v1/retrieve", {"prompt": "user listened", "beam_width": 4}
    missing = client.post(url, json=body)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert client.post(url, json=body, headers={"Authorization": "Bearer not-the-token"}).status_code == 401
    assert client.post(url, json=body, headers=AUTH).status_code == 200
    assert client.get(f"{guarded_url}/v1/model").status_code == 401
    assert client.get(f"{guarded_url}/v1/model", headers=AUTH).status_code == 200
    assert client.get(f"{guarded_url}/healthz").status_code == 200  # probes need no token


def test_auth_is_read_before_the_body_and_a_trickled_body_ends_at_its_deadline(guarded_url):
    """A client that sends its headers and then too little of its body holds an ingress slot for
    body_timeout_s at most (408); without the token it is refused at once (401), its body never waited for."""
    head = {"Content-Type": "application/json", "Content-Length": "100"}
    status, code, _ = raw_post(guarded_url, "/v1/retrieve", head, [b'{"prompt": "user'])
    assert (status, code) == (401, "unauthorized")  # had it waited for the body, the answer would be the 408
    status, code, seconds = raw_post(guarded_url, "/v1/retrieve", head | AUTH, [b'{"prompt": "user'])
    assert (status, code) == (408, "timeout") and 2 <= seconds < 10


def test_two_authorization_headers_are_a_401_whichever_is_right(guarded_url):
    """Two Authorization headers (httpx would merge them: a raw socket sends both) are refused in either order: a
    proxy in front that read the first would otherwise disagree with the ingress, which read the last."""
    (right,) = AUTH.items()
    wrong = ("Authorization", "Bearer not-the-token")
    body = json.dumps({"prompt": "user listened"}).encode()  # a request both routes take
    head = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    for route in ("/v1/retrieve", "/v1/prompt"):
        for twice in ([wrong, right], [right, wrong], [right, right]):
            status, code, _ = raw_post(guarded_url, route, head + twice, [body])
            assert (status, code) == (401, "unauthorized"), (route, twice)
        assert raw_post(guarded_url, route, [*head, right], [body])[0] == 200  # one right header passes


def test_a_null_where_an_object_must_be_is_a_422_in_genrecs_words(guarded_url, client):
    """Over Serve, as tests/test_http_errors.py checks each case: pydantic's words ("Input should be a valid
    dictionary or instance of Candidate") never reach the client (issue #46, item 6)."""
    body = {"prompt": "user listened", "candidates": [{"text": "a"}, None]}
    answer = client.post(f"{guarded_url}/v1/score", json=body, headers=AUTH)
    assert answer.status_code == 422
    message = "must be an object with item_id, text or token_ids; got null"
    assert answer.json()["details"] == [{"field": "candidates[1]", "message": message}]


def test_deadline_is_504_and_changes_live_without_a_restart(guarded_url, tiny_dir, client):
    url = f"{guarded_url}/v1/retrieve"
    body = {"prompt_token_ids": list(range(3, 200)), "beam_width": 32}
    assert client.post(url, json=body, headers=AUTH).status_code == 200
    before = replica_actor_names("guarded", "Ingress") + replica_actor_names("guarded", "EngineServer")
    args = guarded_args(tiny_dir)
    deploy("guarded", deployments=[{"name": "Ingress", "user_config": {"request_timeout_s": 0.001}}], **args)
    late = client.post(url, json=body, headers=AUTH)  # the same request that just took well under 20 s
    assert late.status_code == 504 and late.json()["code"] == "timeout"
    after = replica_actor_names("guarded", "Ingress") + replica_actor_names("guarded", "EngineServer")
    assert after == before  # reconfigured in place: only user_config changed
    deploy("guarded", **args)  # the user_config removed: the builder's deadline again
    assert client.post(url, json=body, headers=AUTH).status_code == 200


def test_a_user_config_that_does_not_validate_keeps_the_running_limits(guarded_url, tiny_dir, client):
    """Live limits Serve hands to the running replicas as they are: refused there, the replicas stay and keep
    their limits (a reconfigure that raised would have them torn down and replaced by ones that fail alike)."""
    from ray import serve

    url, body = f"{guarded_url}/v1/retrieve", {"prompt": "user listened", "beam_width": 4}
    before = replica_actor_names("guarded", "Ingress") + replica_actor_names("guarded", "EngineServer")
    bad = [
        {"name": "Ingress", "user_config": {"request_timeout_s": 0}},
        {"name": "EngineServer", "user_config": {"max_queue": 0, "max_running": 2}},
    ]
    deploy("guarded", deployments=bad, **guarded_args(tiny_dir))
    engine = serve.get_deployment_handle("EngineServer", app_name="guarded")
    refused_by = time.monotonic() + 30
    while (stats := engine.stats.remote().result(timeout_s=30))["user_config_refused"] is None:
        assert time.monotonic() < refused_by, "the engine replica never saw the user_config"
        time.sleep(0.5)
    assert "max_queue" in stats["user_config_refused"]
    assert (stats["limits"]["max_queue"], stats["limits"]["max_running"]) == (256, None)  # as they were
    assert client.post(url, json=body, headers=AUTH).status_code == 200  # the 20 s deadline stayed too
    assert replica_actor_names("guarded", "Ingress") + replica_actor_names("guarded", "EngineServer") == before


def test_a_catalog_change_goes_live_on_every_replica_and_rolls_back(guarded_url, tiny_dir, client, tmp_path):
    """One deploy of the retriever's user_config `catalog`: the running replica loads it (none replaced), every
    answer names its version and /v1/model each replica's; a catalog that does not validate is refused and the
    running one stays; the config without it rolls back to the model directory's catalog (kept built)."""
    from ray import serve

    from genrec.catalog.catalog import Catalog, catalog_version

    url, body = f"{guarded_url}/v1/retrieve", {"prompt": "user listened", "beam_width": 8}
    original = catalog_version(tiny_dir / "genrec/catalog.parquet")
    assert client.post(url, json=body, headers=AUTH).json()["catalog_version"] == original
    catalog = Catalog.load(tiny_dir / "genrec/catalog.parquet")
    kept = np.arange(0, len(catalog), 2)
    half = tmp_path / "half.parquet"
    Catalog(catalog.item_ids[kept], catalog.codes[kept], catalog.lengths[kept]).save(half)
    new = catalog_version(half)
    before = replica_actor_names("guarded", "EngineServer")
    args = guarded_args(tiny_dir)

    def served() -> dict:
        return client.get(f"{guarded_url}/v1/model", headers=AUTH).json()

    deploy("guarded", deployments=[{"name": "EngineServer", "user_config": {"catalog": str(half)}}], **args)
    answer = wait_for(
        lambda: (a := client.post(url, json=body, headers=AUTH).json())["catalog_version"] == new and a,
        "the new catalog answering",
    )
    assert {i["item_id"] for i in answer["items"]} <= set(catalog.item_ids[kept].tolist())
    replica = serve.get_deployment_handle("EngineServer", app_name="guarded").stats.remote().result(timeout_s=30)
    model = wait_for(lambda: (m := served())["replicas"] and m, "the board")
    assert (model["catalog_version"], model["previous_catalog_version"]) == (new, original)
    assert {r["replica"]: r["catalog_version"] for r in model["replicas"]}[replica["replica"]] == new
    assert replica_actor_names("guarded", "EngineServer") == before  # loaded live: no replica replaced

    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    deploy("guarded", deployments=[{"name": "EngineServer", "user_config": {"catalog": str(broken)}}], **args)
    model = wait_for(lambda: (m := served())["catalog_refused"] and m, "the refusal")
    assert "Parquet" in model["catalog_refused"] and model["catalog_version"] == new
    assert client.post(url, json=body, headers=AUTH).json()["catalog_version"] == new

    deploy("guarded", **args)  # the catalog removed from the user_config: the model directory's again
    wait_for(lambda: client.post(url, json=body, headers=AUTH).json()["catalog_version"] == original, "rollback")
    assert served()["previous_catalog_version"] == new
    assert replica_actor_names("guarded", "EngineServer") == before


def test_a_restarted_replica_serves_its_declared_catalog_or_refuses_never_another(
    guarded_url, tiny_dir, client, tmp_path
):
    """The user_config declares a catalog with items retired; its file is removed and the replica killed under
    load: the replacement cannot load it and refuses (503 catalog_not_served naming it) rather than serve the model's
    own catalog: no answer holds a retired item; /v1/model, /healthz and a gauge say so. The file restored, the
    replica loads it on its own (the config is unchanged: Serve sends no reconfigure)."""
    import ray

    from genrec.catalog.catalog import Catalog, catalog_version

    catalog = Catalog.load(tiny_dir / "genrec/catalog.parquet")
    kept = np.arange(0, len(catalog), 2)
    live_items = set(catalog.item_ids[kept].tolist())
    declared = tmp_path / "retired.parquet"
    Catalog(catalog.item_ids[kept], catalog.codes[kept], catalog.lengths[kept]).save(declared)
    version, saved = catalog_version(declared), declared.read_bytes()
    user_config = [{"name": "EngineServer", "user_config": {"catalog": str(declared)}}]
    deploy("guarded", deployments=user_config, **guarded_args(tiny_dir))
    url, body = f"{guarded_url}/v1/retrieve", {"prompt": "user listened", "beam_width": 16}
    wait_for(lambda: client.post(url, json=body, headers=AUTH).json()["catalog_version"] == version, "the catalog")
    declared.unlink()
    answers, stop = [], threading.Event()

    def load():
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                answers.append(c.post(url, json=body, headers=AUTH))

    workers = [threading.Thread(target=load) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        (name,) = replica_actor_names("guarded", "EngineServer")
        time.sleep(1)  # answers before the kill too
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        health = wait_for(
            lambda: (h := client.get(f"{guarded_url}/healthz")).json().get("code") == "catalog_not_served" and h,
            "healthz",
            120,
        )
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert health.status_code == 503 and str(declared) not in health.json()["message"]  # /healthz needs no token
    model = client.get(f"{guarded_url}/v1/model", headers=AUTH).json()
    assert (model["catalog_status"], model["catalog_declared"], model["catalog_version"]) == (
        "refusing",
        str(declared),
        None,
    )
    assert [(r["catalog_status"], r["catalog_declared"]) for r in model["replicas"]] == [("refusing", str(declared))]
    served = [a.json() for a in answers if a.status_code == 200]
    assert served and all({i["item_id"] for i in a["items"]} <= live_items for a in served)
    assert {a.json()["catalog_version"] for a in answers if a.status_code == 200} == {version}
    refused = [a for a in answers if a.status_code != 200]
    assert {a.status_code for a in refused} <= {503, 504}, [a.text for a in refused]  # 504: no replica yet
    assert {a.json()["code"] for a in refused} <= {"catalog_not_served", "unavailable", "timeout"}
    late = client.post(url, json=body, headers=AUTH)
    assert (late.status_code, late.json()["code"], late.headers["retry-after"]) == (503, "catalog_not_served", "1")
    assert str(declared) in late.json()["message"]
    assert all(a.headers["retry-after"] == "1" for a in refused if a.status_code == 503)
    port = ray.nodes()[0]["MetricsExportPort"]

    def gauge():
        lines = [ln for ln in client.get(f"http://127.0.0.1:{port}/metrics").text.splitlines() if "guarded" in ln]
        refusing = exported(lines, "ray_genrec_catalog_not_declared", 'state="refusing"') == 1
        return refusing and (exported(lines, "ray_genrec_catalog_not_declared_s") or 0) > 0  # since its start

    wait_for(gauge, "the gauge")
    declared.write_bytes(saved)
    answer = wait_for(lambda: (a := client.post(url, json=body, headers=AUTH)).status_code == 200 and a, "reload", 60)
    assert answer.json()["catalog_version"] == version and client.get(f"{guarded_url}/healthz").status_code == 200


CONVERGED_WITHIN_S = 10.0  # the goal's bound: a check period (2 s) plus the tiny catalog's load, on a loaded machine


def declares(answer, version: str) -> bool:
    return answer.status_code == 200 and answer.json()["catalog_version"] == version


def test_a_replica_converges_on_its_declared_catalog_when_the_file_arrives_or_changes(
    guarded_url, tiny_dir, client, tmp_path
):
    """Deployed as `serve deploy` does (no genrec check), the config declares a catalog not there yet: the replica
    keeps the one it runs (kept_running, since when it says), across a redeploy of the unchanged config too (Serve
    sends no reconfigure). Once the file is written, every request sent after the bound names the declared version
    and holds no item it lacks; the same after the file is rewritten in place with other items."""
    from genrec.catalog.catalog import Catalog, catalog_version

    catalog = Catalog.load(tiny_dir / "genrec/catalog.parquet")
    url, body = f"{guarded_url}/v1/retrieve", {"prompt": "user listened", "beam_width": 16}
    arriving = tmp_path / "arriving.parquet"
    user_config = [{"name": "EngineServer", "user_config": {"catalog": str(arriving)}}]
    args = guarded_args(tiny_dir)

    def served() -> dict:
        return client.get(f"{guarded_url}/v1/model", headers=AUTH).json()

    deploy("guarded", deployments=user_config, **args)
    model = wait_for(lambda: (m := served())["catalog_status"] == "kept_running" and m, "kept running")
    assert model["catalog_version"] == catalog_version(tiny_dir / "genrec/catalog.parquet")
    assert str(arriving) in model["catalog_refused"] and model["catalog_not_declared_since"] <= time.time()
    deploy("guarded", deployments=user_config, **args)  # the same config again: no reconfigure reaches the replica
    answers, stop = [], threading.Event()

    def load():
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                sent = time.monotonic()
                answers.append((sent, c.post(url, json=body, headers=AUTH)))

    worker = threading.Thread(target=load)
    worker.start()
    try:
        for step in (2, 3):  # the file arrives, then is rewritten in place with other items
            rows = np.arange(0, len(catalog), step)
            written = time.monotonic()
            Catalog(catalog.item_ids[rows], catalog.codes[rows], catalog.lengths[rows]).save(arriving)
            version, items = catalog_version(arriving), set(catalog.item_ids[rows].tolist())

            def converged(version=version, written=written):
                return min((t for t, a in list(answers) if t > written and declares(a, version)), default=None)

            first = wait_for(converged, "an answer from the declared version", 60)
            print(f"converged on the {'arrived' if step == 2 else 'rewritten'} file in {first - written:.2f} s")
            assert first - written <= CONVERGED_WITHIN_S

            def sent_from(first=first):  # three answers, however slowly a loaded machine answers (a second held one)
                return (after := [a for t, a in list(answers) if t >= first])[2:] and after

            after = wait_for(sent_from, "three answers sent from then on")
            assert all(declares(a, version) for a in after), [a.text for a in after]
            assert all({i["item_id"] for i in a.json()["items"]} <= items for a in after)
    finally:
        stop.set()
        worker.join()
    model = served()
    assert (model["catalog_status"], model["catalog_not_declared_since"], model["catalog_refused"]) == (
        "declared",
        None,
        None,
    )
    assert {r["catalog_status"] for r in model["replicas"]} == {"declared"}


def test_without_an_embedding_cache_user_id_scopes_and_routes_and_only_a_placeholder_needs_a_vector(
    guarded_url, client
):
    url = f"{guarded_url}/v1/retrieve"
    plain = client.post(url, json={"prompt": "user listened", "user_id": 7, "beam_width": 4}, headers=AUTH)
    assert plain.status_code == 200, plain.text
    needs = client.post(url, json={"prompt": PROMPT, "user_id": 7, "beam_width": 4}, headers=AUTH)
    assert needs.status_code == 422 and needs.json()["details"][0]["field"] == "user_embedding", needs.text


def test_a_redeploy_of_a_broken_model_directory_is_refused_and_fails_no_request(guarded_url, tiny_dir, tmp_path):
    """A truncated model.safetensors: the builder refuses the deploy naming the file, before Serve replaces any
    replica; the running version answers every request meanwhile."""
    broken = shutil.copytree(tiny_dir, tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    before = replica_actor_names("guarded", "Ingress") + replica_actor_names("guarded", "EngineServer")
    messages = []
    seen, failures = under_load(
        f"{guarded_url}/v1/retrieve",
        lambda: messages.append(deploy_refused("guarded", **guarded_args(broken))),
        headers=AUTH,
    )
    assert f"{weights}: not a complete safetensors file" in messages[0]
    assert failures == [] and seen and set(seen) == {model_version(tiny_dir)}
    assert replica_actor_names("guarded", "Ingress") + replica_actor_names("guarded", "EngineServer") == before


def test_rollout_to_a_new_model_fails_no_request(guarded_url, tiny_dir, tmp_path):
    """A rollout of a one-replica engine starts the new replica before it stops the old (the surge): an engine
    replica runs throughout, so no request waits out a start."""
    from dataclasses import replace

    new_dir = write_model_dir(tmp_path / "v2", replace(TINY, seed=2))
    old_version, new_version = model_version(tiny_dir), model_version(new_dir)
    running, done = [], threading.Event()

    def sample():  # the engine's running replicas, while Serve lists its replicas (not while the app is rebuilt)
        while not done.is_set():
            states = deployment_states("guarded").get("EngineServer")
            if states is not None:
                running.append(states.get("RUNNING", 0))
            time.sleep(0.2)

    def rollout():
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            deploy("guarded", **guarded_args(new_dir))
            time.sleep(2)
        finally:
            done.set()
            sampler.join()

    seen, failures = under_load(f"{guarded_url}/v1/retrieve", rollout, headers=AUTH)
    assert failures == []
    assert seen[0] == old_version and seen[-1] == new_version
    assert len(running) > 5 and min(running) >= 1, running


# -- overload ------------------------------------------------------------------------------------


def test_overload_sheds_load_with_503_and_retry_after(serve_url, tiny_dir):
    """Both refusals are 503 + the configured Retry-After. One app lets all 24 requests reach its replica (one
    runs, one waits in the engine, the rest find the engine's queue full); the other admits one request to its
    replica and queues one in Serve's handle, so the rest are refused there. Two apps, not one: with a single
    one, how many requests reach the engine before the handle queue fills is a race."""

    def tight(max_ongoing_requests: int, max_queued_requests: int) -> dict:
        deployment = {"max_ongoing_requests": max_ongoing_requests, "max_queued_requests": max_queued_requests}
        engine = {"model_dir": str(tiny_dir), "limits": {"max_queue": 1, "max_running": 1}, "deployment": deployment}
        return {"retriever": engine, "ingress": {"retry_after_s": 3}}

    deploy_many({"tight-engine": (None, tight(24, 100)), "tight-handle": (None, tight(1, 1))})
    try:
        body = {"prompt_token_ids": list(range(3, 400)), "beam_width": 64}
        refusals = {"tight-engine": "engine queue is full", "tight-handle": "the engines' queues are full"}
        for app, refusal in refusals.items():
            url = f"{serve_url}/{app}/v1/retrieve"
            with ThreadPoolExecutor(24) as pool, httpx.Client(timeout=60) as c:
                responses = list(pool.map(lambda _, url=url: c.post(url, json=body), range(24)))
            assert {r.status_code for r in responses} <= {200, 503}, [r.text for r in responses if r.status_code >= 500]
            shed = [r for r in responses if r.status_code == 503]
            assert shed and any(r.status_code == 200 for r in responses), app
            assert all(r.headers["retry-after"] == "3" and r.json()["code"] == "overloaded" for r in shed)
            assert {r.json()["message"].split(" (")[0] for r in shed} == {refusal}, app
    finally:
        for app in ("tight-engine", "tight-handle"):
            delete(app)


# -- metrics -------------------------------------------------------------------------------------


def test_engine_metrics_reach_prometheus(open_url, client):
    import ray

    returning = {"prompt_token_ids": [3 + i % 150 for i in range(100)], "beam_width": 4, "cache_scope": "user-1"}
    for _ in range(2):  # the second reuses the first's prompt (one scope): the prefix cache's counters move
        client.post(f"{open_url}/v1/retrieve", json=returning)
    port = ray.nodes()[0]["MetricsExportPort"]
    assert client.post(f"{open_url}/v1/retrieve", json={"prompt": "x", "beam_widht": 4}).status_code == 422
    wanted = (
        "ray_genrec_http_requests_total",  # the ingress's own answers, its 4xx included
        "ray_genrec_requests",
        "ray_genrec_request_latency_s",
        "ray_genrec_queue_depth",
        "ray_genrec_rows_per_step",
        "ray_genrec_prefix_cache_tokens_reused_total",
        "ray_genrec_prefix_cache_tokens_prompted_total",
        "ray_genrec_prefix_cache_hits_total",
        "ray_genrec_prefix_cache_bytes_held",
        "ray_genrec_prefix_cache_spills_total",  # no host tier here: it never moves, and is there at 0
    )
    moved = {  # series that must have moved: (name, tags) -> at least
        ("ray_genrec_requests_total", 'kind="retrieve"', 'status="ok"'): 1,
        ("ray_genrec_http_requests_total", 'route="/v1/retrieve"', 'status="422"'): 1,  # never reached the engine
        ("ray_genrec_prefix_cache_tokens_reused_total",): 96,  # six whole blocks of the repeated prompt
    }
    deadline = time.monotonic() + 60
    while True:  # counters start at 0 and Ray exports every second: wait for the values, not the names
        text = client.get(f"http://127.0.0.1:{port}/metrics").text
        lines = [line for line in text.splitlines() if 'application="open"' in line]
        values = {series: exported(lines, *series) for series in moved}
        present = all(any(line.startswith(name) for line in lines) for name in wanted)
        if present and all((values[k] or 0) >= least for k, least in moved.items()):
            break
        assert time.monotonic() < deadline, (values, sorted({ln.split("{")[0] for ln in lines}))
        time.sleep(0.5)  # the session's Ray exports every second (tests/conftest.py)
    # Every kind served with every status starts at 0: an error ratio reads 0 before the first error.
    assert exported(lines, "ray_genrec_requests_total", 'kind="score"', 'status="stopped"') == 0
    assert exported(lines, "ray_genrec_prefix_cache_spills_total") == 0


def exported(lines: list[str], name: str, *tags: str) -> float | None:
    """The value of the first exported series of this metric carrying these tags (None: none)."""
    for line in lines:
        if line.split("{", 1)[0] == name and all(tag in line for tag in tags):
            return float(line.rsplit(" ", 1)[1])
    return None


# -- a killed engine replica (its own app: the other tests' replicas stay as they are) -------------


def wait_until_replica_holds(handle, at_least: int, wait_s: float = 60) -> None:
    """Wait until the (only) replica behind the handle holds this many requests, running or waiting."""
    deadline = time.monotonic() + wait_s
    while True:
        metrics = handle.stats.remote().result(timeout_s=30)["metrics"]
        if metrics["running"] + metrics["queue_depth"] >= at_least:
            return
        assert time.monotonic() < deadline, f"the replica holds fewer than {at_least} requests: {metrics}"
        time.sleep(0.05)


def test_killed_engine_replica_is_replaced_and_requests_end(serve_url, tiny_dir):
    import ray
    from ray import serve

    # No prefix cache: every request prefills its whole prompt, so requests are still in flight at the kill.
    deploy(
        "victim",
        retriever={"model_dir": str(tiny_dir), "prefix_cache_bytes": 0},
        ingress={"limits": {"request_timeout_s": 20}},
    )
    url = f"{serve_url}/victim/v1/retrieve"
    body = {"prompt_token_ids": [3 + i % 200 for i in range(4000)], "beam_width": 256}  # ~1 s each: in flight
    try:
        with httpx.Client(timeout=60) as c:
            assert c.post(url, json=body).status_code == 200
            (name,) = replica_actor_names("victim", "EngineServer")
            with ThreadPoolExecutor(8) as pool:
                futures = [pool.submit(c.post, url, json=body) for _ in range(8)]
                wait_until_replica_holds(serve.get_deployment_handle("EngineServer", app_name="victim"), at_least=2)
                ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
                responses = [f.result() for f in futures]
            # Every request ended with an answer (a hung one would raise the client's timeout instead).
            assert all(r.status_code in (200, 503, 504) for r in responses), [r.text for r in responses]
            held = [r for r in responses if r.status_code == 503]  # the ones the dead replica held
            assert held and all(r.json()["code"] == "unavailable" for r in held), [r.status_code for r in responses]
            resume_by = time.monotonic() + 240
            while c.post(url, json=body).status_code != 200:
                assert time.monotonic() < resume_by, "service did not resume after the replica was killed"
                time.sleep(1)
        assert replica_actor_names("victim", "EngineServer") not in ([], [name])
    finally:
        delete("victim")
