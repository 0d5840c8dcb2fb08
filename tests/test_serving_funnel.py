"""The two-stage funnel in one Serve app (a Qwen3 retriever, an HSTU ranker): the merge of the stages without Ray;
then over real HTTP, the answer equal to Engine.recommend then Engine.rank in process, each user on one replica of
both deployments, client mistakes a 422 naming the field, the one deadline, without `history` the retriever's
recommend as ever, a redeploy with a ranker whose config.json disagrees with its tensors refused under load, and
without its ranker (killed, or never started) the retrieval alone in beam order at once, marked degraded and counted
(or, set to fail, a 503)."""

import json
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from genrec.api import (
    Event,
    RankedItem,
    RankRequest,
    RankResult,
    RecommendedItem,
    RecommendRequest,
    RecommendResult,
    RetrieveRequest,
)
from genrec.errors import EngineStopped, InvalidRequestError, Overloaded, RequestTimeout
from genrec.model.directory import model_version
from genrec.serving import funnel
from genrec.serving.http_errors import EngineUnavailable, NotServed, error_response
from genrec.serving.router import ROUTING_KEY, rendezvous_order
from genrec.serving.schemas import ModelInfo, RecommendBody
from tests.conftest import HSTU_TINY, TINY
from tests.serve_apps import (
    delete,
    deploy,
    deploy_many,
    deploy_refused,
    deploy_started,
    deployment_states,
    replica_actor_names,
    sticky,
    wait_for,
)

PROMPT = "user <|user|> listened to comedy podcast episode then news daily"
RANKER_LIMIT = 64  # the ranker's max_candidates in the funnel app
TWO = {"kv_budget_bytes": 32 << 20, "deployment": {"num_replicas": 2}}  # an engine section: two replicas


def item(i: int) -> str:
    return f"item-{i:06d}"


def history(seed: int, n: int = 30) -> list[dict]:
    rng, t, events = random.Random(seed), 1e9, []
    for _ in range(n):
        t += rng.choice([5.0, 300.0, 86400.0])
        events.append(
            {"item_id": item(rng.randrange(HSTU_TINY.items)), "action": rng.choice([0, 1, 2]), "timestamp": t}
        )
    return events


def vector(seed: int) -> list[float]:
    return np.random.default_rng(seed).normal(size=TINY.user_dim).round(4).tolist()


# -- the merge, without Ray -------------------------------------------------------------------------


def stage1(*retrieved, given=()) -> RecommendResult:
    """Stage 1's answer as the retriever's recommend in beam order gives it: the retrieved items, then the given
    ones kept and not retrieved (the rule itself is the decoder's: tests/test_recommend.py)."""
    items = [
        RecommendedItem(item_id=i, semantic_id=[k], retrieval_logprob=-k, code_logprob=-k,
                        source="retrieved+given" if i in given else "retrieved")
        for k, i in enumerate(retrieved)
    ]  # fmt: skip
    items += [RecommendedItem(item_id=g, semantic_id=[9], source="given") for g in given if g not in retrieved]
    return RecommendResult(items=items, prompt_tokens=7, catalog_version="c-1")


def ranked(**probs) -> RankResult:
    return RankResult(items=[RankedItem(item_id=i, scores={"click": p, "like": 1 - p}) for i, p in probs.items()],
                      history_events=3)  # fmt: skip


def merged(first: RecommendResult, ranking: RankResult | None, task: str, n: int) -> RecommendResult:
    return funnel.merge(first, ranking, task, n, "v-1")


def test_the_merge_orders_by_the_task_ties_and_unranked_in_stage1_order():
    first = stage1("a", "b", "c", "d", "e")
    answer = merged(first, ranked(a=0.2, b=0.9, d=0.2, e=0.5), "click", 5)
    assert [i.item_id for i in answer.items] == ["b", "e", "a", "d", "c"]  # a and d tie: stage-1 order; c unranked
    assert answer.items[0].ranker_scores == {"click": 0.9, "like": pytest.approx(0.1)}
    last = answer.items[-1]
    assert last.ranker_scores is None and last.retrieval_logprob == last.code_logprob == -2  # stage-1 fields
    assert last.score_logprob is None and last.prob is None  # no label in a two-stage recommend
    assert (answer.rank_task, answer.ranker_version, answer.prompt_tokens) == ("click", "v-1", 7)
    assert answer.catalog_version == "c-1" and not answer.degraded
    by_like = merged(first, ranked(a=0.2, b=0.9, d=0.2, e=0.5), "like", 2)
    assert [i.item_id for i in by_like.items] == ["a", "d"]  # truncated to num_results
    assert [i.item_id for i in merged(first, None, "click", 3).items] == ["a", "b", "c"]


def test_given_items_are_ranked_with_the_retrieved():
    answer = merged(stage1("a", "b", given=("b", "x")), ranked(a=0.1, b=0.2, x=0.9), "click", 5)
    want = [("x", "given"), ("b", "retrieved+given"), ("a", "retrieved")]
    assert [(i.item_id, i.source) for i in answer.items] == want
    assert answer.items[0].retrieval_logprob is None


def test_a_ranker_that_knows_none_of_the_items_leaves_stage1s_order_not_degraded():
    first = stage1("a", "b", given=("x",))
    answer = merged(first, RankResult(items=[], history_events=3), "click", 5)
    assert [i.item_id for i in answer.items] == ["a", "b", "x"]
    assert all(i.ranker_scores is None for i in answer.items) and not answer.degraded
    assert (answer.rank_task, answer.ranker_version) == ("click", "v-1")


def test_a_degraded_answer_is_stage1_in_beam_order_the_given_after():
    answer = funnel.degraded(stage1("a", "b", "c", given=("x", "b")), 4, "ranker_timeout")
    want = [("a", "retrieved"), ("b", "retrieved+given"), ("c", "retrieved"), ("x", "given")]
    assert [(i.item_id, i.source) for i in answer.items] == want
    assert (answer.degraded, answer.degraded_reason) == (True, "ranker_timeout")
    assert answer.rank_task is None and answer.ranker_version is None  # no ranker took part
    assert all(i.ranker_scores is None for i in answer.items) and answer.items[0].retrieval_logprob == 0
    assert answer.prompt_tokens == 7
    assert [i.item_id for i in funnel.degraded(stage1("a", "b", "c"), 2, "ranker_timeout").items] == ["a", "b"]


def test_the_merge_equals_a_plain_reference_on_random_inputs():
    rng = random.Random(29)
    for _ in range(200):
        pool = [f"i{k}" for k in range(12)]
        beam = rng.sample(pool, rng.randint(0, 8))
        given = rng.sample([p for p in pool if p not in beam], rng.randint(0, 3))
        known = [i for i in beam + given if rng.random() < 0.6]
        probs = {i: rng.choice([0.1, 0.5, 0.9]) for i in known}  # ties: stage-1 order
        n = rng.randint(1, 12)
        answer = merged(stage1(*beam, given=given), ranked(**probs), "click", n)
        items = beam + given
        want = sorted(known, key=lambda i: (-probs[i], items.index(i))) + [i for i in items if i not in probs]
        assert [i.item_id for i in answer.items] == want[:n]


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (Overloaded("the ranker's queues are full"), "ranker_overloaded"),
        (RequestTimeout("no answer within 4 s"), "ranker_timeout"),
        (EngineUnavailable("the ranker replica is unavailable (RayActorError); retry"), "ranker_unavailable"),
        (EngineStopped("the engine is shut down"), "ranker_unavailable"),
        (RuntimeError("a bug in the ranker"), "ranker_error"),
        (InvalidRequestError("history[0].item_id", "not in the ranker's catalog"), None),
        (NotServed("rank", "qwen3", ["retrieve"]), None),
    ],
)
def test_why_stage2_failed_and_a_client_mistake_stays_the_clients(error, reason):
    assert funnel.degraded_reason(error) == reason
    if reason is None:  # not a degradation: the client's 4xx
        assert 400 <= error_response(error).status_code < 500
    else:
        assert reason in funnel.REASONS


def test_stage1_keeps_a_reserve_for_stage2_and_at_least_half_the_deadline():
    assert funnel.stage1_timeout(30.0, 1.0) == 29.0
    assert funnel.stage1_timeout(4.0, 0.0) == 4.0
    assert funnel.stage1_timeout(1.0, 5.0) == 0.5  # a deadline changed live below the reserve: half each


def test_what_the_stages_are_sent():
    body = RecommendBody(prompt="p", beam_width=8, num_results=3, history=[Event(item_id="x")], request_id="r",
                         candidates=[{"item_id": "c"}], exclude_item_ids=["e"], filters={"genre": "drama"},
                         allowed_item_ids=["a", "c"])  # fmt: skip
    request = body.to_request(None)
    first = funnel.stage1(request)
    assert isinstance(first, RecommendRequest) and first.num_results == 8  # every beam goes to the ranker
    assert first.rank_by == "beam" and first.labels is None  # nothing scored: the ranker orders
    assert (first.exclude_item_ids, first.request_id, first.candidates) == (["e"], "r", request.candidates)
    assert (first.filters, first.allowed_item_ids) == (request.filters, ["a", "c"])
    rank = funnel.stage2(body, stage1("a", "b", given=("c",)).items)
    assert (rank.candidates, rank.history, rank.request_id) == (["a", "b", "c"], body.history, "r")
    assert rank.unknown_candidates == "skip"  # the ranker leaves out what it does not know, after the history
    assert funnel.stage2(body, []) is None
    widths = RecommendBody(prompt="p", beam_widths=[2, 4, 6], num_results=3, history=[Event(item_id="x")])
    assert funnel.stage1(widths.to_request(None)).num_results == 6


def ranker_info(**fields) -> ModelInfo:
    unset = dict.fromkeys(("levels", "max_beam_width", "max_prompt_tokens", "max_candidate_len", "user_dim"))
    base = {"version": "v", "model_dir": "/r", "device": "cpu", "family": "hstu", "serves": ["rank"],
            "catalog_items": 5, "max_candidates": 10, "tasks": ["click", "like"], "max_history_events": 4}  # fmt: skip
    return ModelInfo(**base | unset | fields)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"rank_task": "buy"}, "rank_task"),
        ({"candidates": [{"item_id": "a"}, {"text": "a show"}]}, "candidates[1].text"),
        ({"candidates": [{"token_ids": [5]}]}, "candidates[0].token_ids"),
        ({"history": [{"item_id": "x"}] * 5}, "history"),
        ({"beam_width": 9, "candidates": [{"item_id": "a"}, {"item_id": "b"}]}, "beam_width"),
        ({"rank_by": "joint"}, "rank_by"),
        ({"labels": ["yes", "no"]}, "labels"),
    ],
)
def test_what_the_ranker_would_refuse_is_refused_before_stage1(fields, field):
    body = RecommendBody(**{"prompt": "p", "beam_width": 4, "history": [{"item_id": "x"}]} | fields)
    with pytest.raises(InvalidRequestError) as error:
        funnel.check_body(body, ranker_info())
    assert error.value.field == field
    assert (
        funnel.check_body(RecommendBody(prompt="p", beam_width=4, history=[{"item_id": "x"}]), ranker_info()) == "click"
    )


# -- over HTTP ----------------------------------------------------------------------------------------


STICKY = sticky("EngineServer", "RankerServer")  # the funnel's engines: see the user-stickiness test


@pytest.fixture(scope="module")
def funnel_args(tiny_dir, hstu_dir):
    ranker = {"model_dir": str(hstu_dir), "max_candidates": RANKER_LIMIT, **TWO}
    ranker["deployment"] = ranker["deployment"] | {"ray_actor_options": {"num_cpus": 0.15}}
    return {
        "retriever": {"model_dir": str(tiny_dir), "threads": 1, **TWO},
        "ranker": ranker,
        "ingress": {"limits": {"request_timeout_s": 20}},
    }


@pytest.fixture(scope="module")
def urls(serve_url, tiny_dir, funnel_args):
    """A funnel app (two replicas of each engine deployment) and a plain one (no ranker), started side by side
    (slow on a loaded 2-core machine: given longer than Serve's own 60 s)."""
    plain = {
        "retriever": {
            "model_dir": str(tiny_dir),
            "threads": 1,
            "deployment": {"ray_actor_options": {"num_cpus": 0.1}},
        }
    }
    deploy_many({"funnel": (STICKY, funnel_args), "plain": (None, plain)})
    yield {"funnel": f"{serve_url}/funnel", "plain": f"{serve_url}/plain"}
    delete("funnel")
    delete("plain")


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=60) as c:
        yield c


def in_process(engine, ranker, body: dict) -> list[tuple[str, dict | None]]:
    """Stage 1 and stage 2 with Engine.retrieve then Engine.rank, merged as the funnel documents it."""
    fields = {k: v for k, v in body.items() if k not in ("history", "rank_task", "user_id", "candidates")}
    (stage1,) = engine.retrieve([RetrieveRequest(**fields | {"num_results": body["beam_width"]})])
    given = [c["item_id"] for c in body.get("candidates", [])]
    items = [i.item_id for i in stage1.items] + [g for g in given if g not in {i.item_id for i in stage1.items}]
    known = [i for i in items if ranker.catalog.row_of(i) is not None]
    (stage2,) = ranker.rank([RankRequest(history=body["history"], candidates=known)])
    scores = {i.item_id: i.scores for i in stage2.items}
    task = body.get("rank_task", HSTU_TINY.tasks[0])
    order = sorted(range(len(items)), key=lambda k: (items[k] not in scores, -scores.get(items[k], {task: 0})[task], k))
    return [(items[k], scores.get(items[k])) for k in order][: body["num_results"]]


def test_the_answer_is_stage1_then_stage2(urls, client, engine, ranker, tiny_dir, hstu_dir):
    bodies = [
        {"prompt": PROMPT, "user_embedding": vector(1), "beam_width": 40, "num_results": 25, "history": history(1)},
        {"prompt": PROMPT, "user_embedding": vector(2), "beam_width": 16, "num_results": 16, "history": history(2, 5),
         "rank_task": HSTU_TINY.tasks[1], "candidates": [{"item_id": item(7)}, {"item_id": item(250)}]},
    ]  # fmt: skip
    unranked = 0
    for body in bodies:
        response = client.post(f"{urls['funnel']}/v1/recommend", json=body)
        assert response.status_code == 200, response.text
        assert response.headers["x-model-version"] == model_version(tiny_dir)
        assert response.headers["x-ranker-version"] == model_version(hstu_dir)
        got = response.json()
        assert (got["ranker_version"], got["rank_task"]) == (model_version(hstu_dir), body.get("rank_task", "click"))
        want = in_process(engine, ranker, body)
        assert [i["item_id"] for i in got["items"]] == [item_id for item_id, _ in want]
        for got_item, (_, scores) in zip(got["items"], want, strict=True):
            assert got_item["retrieval_logprob"] is not None or got_item["source"] == "given"
            if scores is None:  # the retriever's catalog (300 items) holds items the ranker's (120) does not
                unranked += 1
                assert got_item["ranker_scores"] is None
            else:
                assert got_item["ranker_scores"] == pytest.approx(scores, abs=1e-4)
    assert unranked > 0


def replica_counts(app: str, deployment: str, kind: str) -> dict[str, tuple[int, int]]:
    """(requests of `kind` served, prompt tokens or events read from the prefix cache) of each of the deployment's
    two replicas, asked of each through a handle."""
    from ray import serve

    handle, counts = serve.get_deployment_handle(deployment, app_name=app), {}
    for i in range(200):  # a random routing key reaches each replica in a few tries
        stats = handle.stats.remote(**{ROUTING_KEY: f"probe-{random.random()}-{i}"}).result(timeout_s=30)
        metrics = stats["metrics"]
        counts[stats["replica"]] = (metrics["requests"].get(kind, 0), metrics["prefix_cache"]["tokens_reused"])
        if len(counts) == 2:
            return counts
    raise AssertionError(f"reached only {sorted(counts)} of {deployment}'s 2 replicas")


def test_each_user_stays_on_one_replica_of_both_deployments_which_keeps_their_context(urls, client):
    kinds = {"EngineServer": "recommend:ok", "RankerServer": "rank:ok"}
    for user in ("alice", "bob", "carol"):
        before = {d: replica_counts("funnel", d, k) for d, k in kinds.items()}
        for visit in range(3):  # a returning user: the same start of prompt and history, more of each every time
            body = {"prompt": f"{user} {PROMPT} {PROMPT}" + " news" * visit, "user_embedding": vector(3),
                    "beam_width": 8, "history": history(hash(user) % 100, 20 + visit), "user_id": user}  # fmt: skip
            assert client.post(f"{urls['funnel']}/v1/recommend", json=body).status_code == 200
        for deployment, counts in before.items():
            after = replica_counts("funnel", deployment, kinds[deployment])
            home = rendezvous_order(f"user:{user!r}", list(after))[0]
            served = {r: after[r][0] - counts[r][0] for r in after if after[r][0] > counts[r][0]}
            assert served == {home: 3}, (deployment, user, served)
            # visits 2 and 3 read at least the first 16-token (16-event) block of the first from its cache
            assert after[home][1] - counts[home][1] >= 2 * 16, (deployment, user, counts[home], after[home])


def test_without_history_recommend_is_the_retrievers_alone(urls, client, engine):
    request = RecommendRequest(prompt=PROMPT, user_embedding=vector(4), beam_width=8, num_results=5)
    (want,) = engine.recommend([request])
    for app in ("funnel", "plain"):
        response = client.post(f"{urls[app]}/v1/recommend", json=request.model_dump(exclude_none=True))
        assert response.status_code == 200, response.text
        got = response.json()
        assert "x-ranker-version" not in response.headers and got["ranker_version"] is got["rank_task"] is None
        assert [i["item_id"] for i in got["items"]] == [i.item_id for i in want.items]
        assert [i["score_logprob"] for i in got["items"]] == pytest.approx(
            [i.score_logprob for i in want.items], abs=1e-4
        )
        assert all(i["ranker_scores"] is None for i in got["items"])


GOOD = {"prompt": "user listened to comedy podcast", "beam_width": 8, "history": history(5, 3)}
BAD = [
    ("funnel", {**GOOD, "rank_task": "purchase"}, "rank_task"),
    ("funnel", {**GOOD, "candidates": [{"text": "a science show"}]}, "candidates[0].text"),
    ("funnel", {**GOOD, "history": [{"item_id": "no-such-item"}]}, "history[0].item_id"),
    ("funnel", {**GOOD, "history": [{"item_id": item(1), "action": HSTU_TINY.actions}]}, "history[0].action"),
    ("funnel", {**GOOD, "history": []}, "history"),
    ("funnel", {**GOOD, "history": [{"item_id": item(1)}] * HSTU_TINY.max_positions}, "history"),
    ("funnel", {**GOOD, "beam_width": RANKER_LIMIT + 1}, "beam_width"),
    ("funnel", {**GOOD, "history": None, "rank_task": "click"}, "rank_task"),
    ("plain", GOOD, "history"),
]


@pytest.mark.parametrize(("app", "body", "field"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_client_mistakes_are_422_naming_the_field(urls, client, app, body, field):
    response = client.post(f"{urls[app]}/v1/recommend", json=body)
    assert response.status_code == 422, response.text[:2000]
    assert response.json()["code"] == "invalid_request" and field in response.text


def test_rank_model_and_health_account_for_the_ranker(urls, client, hstu_dir, tiny_dir):
    rank = {"history": history(6, 4), "candidates": [item(3), item(4)]}
    response = client.post(f"{urls['funnel']}/v1/rank", json=rank)
    assert response.status_code == 200 and response.headers["x-model-version"] == model_version(hstu_dir)
    info = client.get(f"{urls['funnel']}/v1/model").json()
    assert (info["family"], info["version"]) == ("qwen3", model_version(tiny_dir))
    assert (info["ranker"]["family"], info["ranker"]["tasks"]) == ("hstu", list(HSTU_TINY.tasks))
    assert client.get(f"{urls['plain']}/v1/model").json()["ranker"] is None
    health = client.get(f"{urls['funnel']}/healthz").json()
    assert health == {
        "status": "ok",
        "model_version": info["version"],
        "ranker_version": model_version(hstu_dir),
        "catalog": {"declared": 2, "kept_running": 0, "refusing": 0},  # the retriever's two replicas
    }


def test_without_an_embedding_cache_a_user_id_alone_is_a_scope_and_routing_key(urls, client):
    """The funnel app has no embedding cache: a user_id with no user_embedding is answered where the prompt has no
    <|user|> placeholder; where it has one, the 422 names user_embedding."""
    body = {"prompt": "user listened to comedy podcast", "user_id": "u-9", "beam_width": 8, "history": history(9, 3)}
    answered = client.post(f"{urls['funnel']}/v1/recommend", json=body)
    assert answered.status_code == 200 and not answered.json()["degraded"], answered.text
    needs = client.post(f"{urls['funnel']}/v1/recommend", json=body | {"prompt": PROMPT})
    assert needs.status_code == 422 and needs.json()["details"][0]["field"] == "user_embedding", needs.text


def test_every_series_the_grafana_dashboard_queries_is_exported(urls, client):
    """deployments/grafana/genrec.json against this module's apps: every series a panel queries is on the node's
    metrics endpoint, with the labels the panel filters on (tests/test_grafana_dashboard.py reads the dashboard).
    The funnel app has every engine series and the degraded ones; an embedding cache's shard, the cache's."""
    import ray

    from genrec.cache.actor import EmbeddingCache
    from genrec.cache.config import CacheConfig
    from tests.test_grafana_dashboard import dashboard_series, missing_series

    cache = EmbeddingCache.connect(CacheConfig(name="dashboard-users", dim=TINY.user_dim, capacity=16, store="none"))
    try:
        cache.get(["u-1"])  # a miss
        body = {"prompt": PROMPT, "user_embedding": vector(4), "beam_width": 8, "history": history(4)}
        answer = client.post(f"{urls['funnel']}/v1/recommend", json=body)  # latency: a retrieval and a ranking
        assert answer.status_code == 200, answer.text
        port, wanted = ray.nodes()[0]["MetricsExportPort"], dashboard_series()
        deadline = time.monotonic() + 60
        while gaps := missing_series(wanted, client.get(f"http://127.0.0.1:{port}/metrics").text):
            assert time.monotonic() < deadline, gaps
            time.sleep(0.5)  # the session's Ray exports every second (tests/conftest.py)
    finally:
        for actor in cache.actors:
            ray.kill(actor)


def test_both_stages_share_one_deadline(urls, client, funnel_args):
    """A deadline too short for the two stages is a 504; the deadline changes live (the Ingress's user_config)."""
    before = replica_actor_names("funnel", "RankerServer")
    deploy("funnel", [*STICKY, {"name": "Ingress", "user_config": {"request_timeout_s": 0.001}}], **funnel_args)
    try:
        late = client.post(f"{urls['funnel']}/v1/recommend", json=GOOD)
        assert late.status_code == 504 and late.json()["code"] == "timeout"
        assert replica_actor_names("funnel", "RankerServer") == before
    finally:
        deploy("funnel", STICKY, **funnel_args)  # the app as the module's other tests expect it
    assert client.post(f"{urls['funnel']}/v1/recommend", json=GOOD).status_code == 200


def test_a_redeploy_with_a_ranker_that_disagrees_with_its_config_is_refused_and_fails_no_request(
    urls, funnel_args, hstu_dir, tmp_path
):
    """`num_items` raised in config.json for a grown catalog, the weights not retrained: the builder refuses the
    redeploy naming the tensor before Serve replaces anything, and the running ranker answers every two-stage
    recommend and /v1/rank meanwhile (none degraded, /healthz ok). Before, the ranker was torn down for one that
    could not start, and every ranked request got a 503."""
    grown = shutil.copytree(hstu_dir, tmp_path / "grown")
    config = json.loads((grown / "config.json").read_text())
    (grown / "config.json").write_text(json.dumps(config | {"num_items": config["num_items"] + 50}))
    args = funnel_args | {"ranker": funnel_args["ranker"] | {"model_dir": str(grown)}}
    engines = ("Ingress", "EngineServer", "RankerServer")
    before = [replica_actor_names("funnel", d) for d in engines]
    messages = []
    try:
        answers = under_load(urls["funnel"], lambda: messages.append(deploy_refused("funnel", STICKY, **args)))
        after = [replica_actor_names("funnel", d) for d in engines]
    finally:
        deploy("funnel", STICKY, **funnel_args)  # the config the module's other tests expect, recorded again
    assert f"ranker.model_dir: {grown / 'model.safetensors'}: tensor item_embedding.weight has shape" in messages[0]
    assert f"implies shape [{config['num_items'] + 50}, {config['hidden_size']}]" in messages[0]
    failed = [a for a in answers if a[1] != 200 or a[3]]
    assert not failed, failed[:5]
    assert {route for route, *_ in answers} == {"recommend", "rank", "healthz"}
    assert {version for _, _, version, _ in answers if version is not None} == {model_version(hstu_dir)}
    assert after == before


def test_a_replica_refusing_its_catalog_gets_no_request_a_peer_can_answer(
    urls, client, funnel_args, tiny_dir, tmp_path
):
    """Both retriever replicas serve a declared catalog; its file removed, one is killed: the replacement refuses
    (its routing stats say so) and the user router sends every user to the replica that serves it (those whose
    primary the other is too); /healthz stays 200, counting one of each. The config restored, both serve again."""
    import ray

    declared = tmp_path / "catalog-declared.parquet"
    shutil.copyfile(tiny_dir / "genrec/catalog.parquet", declared)
    url, body = f"{urls['funnel']}/v1/retrieve", {"prompt": "user listened to comedy podcast", "beam_width": 4}

    def replicas() -> list[dict]:
        return client.get(f"{urls['funnel']}/v1/model").json()["replicas"] or []

    def statuses() -> list[str]:
        return sorted(r["catalog_status"] for r in replicas())

    try:
        deploy("funnel", [STICKY[0] | {"user_config": {"catalog": str(declared)}}, STICKY[1]], **funnel_args)
        on_it = [str(declared)] * 2
        wait_for(lambda: [r["catalog_declared"] for r in replicas()] == on_it, "both on the declared catalog")
        declared.unlink()
        victim = replica_actor_names("funnel", "EngineServer")[0]
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        wait_for(lambda: statuses() == ["declared", "refusing"], "the replacement refusing", 120)
        users = [{"user_id": f"user-{i}"} for i in range(24)]  # about half of them have the refusing one as primary
        wait_for(lambda: all(client.post(url, json=body | u).status_code == 200 for u in users), "every user answered")
        health = client.get(f"{urls['funnel']}/healthz")
        assert health.status_code == 200 and health.json()["catalog"] == {
            "declared": 1,
            "kept_running": 0,
            "refusing": 1,
        }
    finally:
        deploy("funnel", STICKY, **funnel_args)  # the model's own catalog: the refusing replica loads it too
    wait_for(lambda: statuses() == ["declared", "declared"], "both serving again")


def under_load(url: str, during, threads: int = 2) -> list[tuple[str, int, str | None, bool]]:
    """Two-stage recommends, ranks and health checks in a loop from `threads` clients while `during()` runs:
    (route, status, the ranker's version, degraded) of each answer."""
    recommend = {"prompt": PROMPT, "user_embedding": vector(8), "beam_width": 8, "history": history(8, 6)}
    routes = [
        ("recommend", "post", recommend),
        ("rank", "post", {"history": history(9, 6), "candidates": [item(3), item(4)]}),
        ("healthz", "get", None),
    ]
    answers, stop = [], threading.Event()

    def load():
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                for route, method, body in routes:
                    path = f"{url}/{route}" if route == "healthz" else f"{url}/v1/{route}"
                    r = c.post(path, json=body) if method == "post" else c.get(path)
                    version = r.headers.get("x-ranker-version" if route == "recommend" else "x-model-version")
                    version = r.json().get("ranker_version") if route == "healthz" and r.status_code == 200 else version
                    degraded = route == "recommend" and r.status_code == 200 and r.json().get("degraded", False)
                    answers.append((route, r.status_code, version, degraded))

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
    return answers


# -- the ranker gone: the funnel degrades (or, set to, fails) -----------------------------------------------------

FRAIL_DEADLINE_S = 8.0  # "at once" is under 7 s: a loaded 2-core machine (two test workers) may take 3-4 s for stage 1


def frail_args(tiny_dir, hstu_dir, ranker_gone: bool, on_failure: str = "degrade") -> dict:
    ranker = {"model_dir": str(hstu_dir), "max_candidates": RANKER_LIMIT}
    if ranker_gone:  # no node can host it, and no surge: Serve stops the running replica and the new one never
        # starts (nor waits out Serve's 20 s grace when it is stopped in turn)
        ranker["deployment"] = {
            "ray_actor_options": {"num_cpus": 64},
            "graceful_shutdown_timeout_s": 1,
            "max_surge_percent": 0,
        }
    ingress = {"limits": {"request_timeout_s": FRAIL_DEADLINE_S}, "funnel_reserve_s": 1.0}
    return {
        "retriever": {"model_dir": str(tiny_dir), "threads": 1},
        "ranker": ranker,
        "ingress": ingress | {"funnel_on_ranker_failure": on_failure},
    }


@pytest.fixture(scope="module")
def frail(serve_url, tiny_dir, hstu_dir):
    """A funnel app of one replica each, its deadline short: its ranker is made to go away."""
    deploy("frail", **frail_args(tiny_dir, hstu_dir, ranker_gone=False))
    yield f"{serve_url}/frail"
    delete("frail")


def without_a_ranker(tiny_dir, hstu_dir, on_failure: str) -> None:
    """Redeploy frail with a ranker that never starts and wait until the old ranker is gone and the new ingress and
    retriever (Serve replaces every replica of an app whose config changed) answer."""
    answering = ("Ingress", "EngineServer")
    before = {name for deployment in answering for name in replica_actor_names("frail", deployment)}
    deploy_started("frail", **frail_args(tiny_dir, hstu_dir, ranker_gone=True, on_failure=on_failure))
    deadline = time.monotonic() + 420
    while True:
        states = deployment_states("frail")
        now = {name for deployment in answering for name in replica_actor_names("frail", deployment)}
        ranker_gone = states.get("RankerServer", {}).get("RUNNING", 0) == 0
        if ranker_gone and all(states.get(d) == {"RUNNING": 1} for d in answering) and not now & before:
            return
        assert time.monotonic() < deadline, states
        time.sleep(0.5)


def timed_post(client: httpx.Client, url: str, body: dict) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = client.post(url, json=body)
    return response, time.monotonic() - started


def killed_ranker_answers(url: str, body: dict) -> tuple[list[float], list[tuple[httpx.Response, float]]]:
    """(seconds of ranked answers before, every answer under load from two clients while the ranker's one replica
    is killed, until the replacement ranks again): the ranker's replacement takes seconds to start."""
    import ray

    with httpx.Client(timeout=60) as client:
        normal = [timed_post(client, url, body) for _ in range(4)]
    assert all(r.status_code == 200 and not r.json()["degraded"] for r, _ in normal), [r.text for r, _ in normal]
    answers, stop = [], threading.Event()

    def load():
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                answers.append(timed_post(c, url, body))

    workers = [threading.Thread(target=load) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        (name,) = replica_actor_names("frail", "RankerServer")
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        deadline = time.monotonic() + 300
        while not (
            answers and any(r.json().get("degraded") for r, _ in answers) and not answers[-1][0].json()["degraded"]
        ):
            assert time.monotonic() < deadline, "no degraded answer, or the ranker's replacement never ranked"
            time.sleep(0.5)
    finally:
        stop.set()
        for w in workers:
            w.join()
    return [seconds for _, seconds in normal], answers


def two_at_once(url: str, body: dict) -> list[tuple[httpx.Response, float]]:
    """Two requests, the second sent a second after the first: ordered by how long they took."""
    with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=60) as client:
        first = pool.submit(timed_post, client, url, body)
        time.sleep(1.0)
        second = timed_post(client, url, body)
        return sorted([first.result(), second], key=lambda answer: answer[1])


def degraded_counts(client: httpx.Client) -> dict[str, float | None]:
    import ray

    port = ray.nodes()[0]["MetricsExportPort"]
    text = client.get(f"http://127.0.0.1:{port}/metrics").text
    lines = [ln for ln in text.splitlines() if 'application="frail"' in ln]
    counts = {}
    for reason in funnel.REASONS:
        found = [ln for ln in lines if ln.startswith("ray_genrec_funnel_degraded_total") and f'reason="{reason}"' in ln]
        counts[reason] = sum(float(ln.rsplit(" ", 1)[1]) for ln in found) if found else None
    return counts


def test_a_killed_ranker_degrades_the_funnel_at_once_not_after_its_replacement_starts(frail, tiny_dir, hstu_dir):
    """With its one ranker replica killed under load, every two-stage recommend answers within three seconds
    of a ranked one (the retrieval, degraded ranker_unavailable: the ingress's router knows the ranker has no
    running replica), not at its deadline while the replacement starts; then the replacement ranks again."""
    deploy("frail", **frail_args(tiny_dir, hstu_dir, ranker_gone=False))  # as the fixture made it
    body = {"prompt": PROMPT, "user_embedding": vector(5), "beam_width": 8, "history": history(5)}
    normal, answers = killed_ranker_answers(f"{frail}/v1/recommend", body)
    assert all(r.status_code == 200 for r, _ in answers), [r.text for r, _ in answers if r.status_code != 200]
    reasons = {r.json()["degraded_reason"] for r, _ in answers if r.json()["degraded"]}
    assert reasons == {"ranker_unavailable"}
    slowest = max(seconds for _, seconds in answers)
    assert slowest <= max(normal) + 3.0 < FRAIL_DEADLINE_S, (normal, sorted(s for _, s in answers)[-5:])


def test_without_its_ranker_the_funnel_answers_the_retrieval_in_beam_order_at_once(
    frail, client, engine, tiny_dir, hstu_dir
):
    body = {"prompt": PROMPT, "user_embedding": vector(7), "beam_width": 8, "num_results": 6, "history": history(7),
            "candidates": [{"item_id": item(250)}, {"item_id": item(7)}]}  # fmt: skip
    ranked = client.post(f"{frail}/v1/recommend", json=body)
    assert ranked.status_code == 200 and ranked.json()["degraded"] is False
    assert ranked.headers["x-ranker-version"] == model_version(hstu_dir)

    without_a_ranker(tiny_dir, hstu_dir, on_failure="degrade")
    answers = two_at_once(f"{frail}/v1/recommend", body)  # the first of a new ingress: its router not made yet
    assert all(seconds < FRAIL_DEADLINE_S - 1 for _, seconds in answers), answers  # not held to the deadline
    fields = {k: v for k, v in body.items() if k not in ("history", "candidates", "num_results")}
    (stage1,) = engine.retrieve([RetrieveRequest(**fields)])  # every beam, in beam order
    beam = [i.item_id for i in stage1.items]  # (given candidates would follow it: see the merge's tests)
    for response, _ in answers:
        assert response.status_code == 200, response.text
        got = response.json()
        assert (got["degraded"], got["degraded_reason"]) == (True, "ranker_unavailable")
        assert got["rank_task"] is got["ranker_version"] is None and "x-ranker-version" not in response.headers
        assert response.headers["x-model-version"] == model_version(tiny_dir)
        assert [i["item_id"] for i in got["items"]] == beam[:6]
        assert [i["retrieval_logprob"] for i in got["items"]] == pytest.approx(
            [i.logprob for i in stage1.items[:6]], abs=1e-4
        )
        assert all(i["ranker_scores"] is None for i in got["items"])

    by = time.monotonic() + 60
    while None in (counts := degraded_counts(client)).values() or counts["ranker_unavailable"] < 2:
        assert time.monotonic() < by, counts  # the session's Ray exports every second (tests/conftest.py)
        time.sleep(0.5)
    assert counts["ranker_timeout"] == counts["ranker_overloaded"] == 0  # every reason's series starts at 0


def test_set_to_fail_the_funnel_without_its_ranker_answers_503_at_once(frail, tiny_dir, hstu_dir):
    without_a_ranker(tiny_dir, hstu_dir, on_failure="fail")
    body = {"prompt": PROMPT, "user_embedding": vector(8), "beam_width": 8, "history": history(8)}
    for response, seconds in two_at_once(f"{frail}/v1/recommend", body):
        assert seconds < FRAIL_DEADLINE_S - 1 and response.status_code == 503, (seconds, response.text)
        assert response.json()["code"] == "unavailable" and response.headers["retry-after"] == "1"
