"""Both model families behind the engine deployment, without Ray: /v1/model's description of each, rank served
by the replica, a request of the other family refused, a not_served error (404, never a 5xx) crossing processes
intact. The HTTP side is tests/test_serving_rank.py."""

import asyncio
import pickle

import pytest

from genrec.api import Event, RankRequest, RetrieveRequest
from genrec.engine import Engine, SchedulerConfig
from genrec.engine.family import Family, Generating
from genrec.errors import InvalidRequestError
from genrec.serving.args import AppArgs
from genrec.serving.engine_server import EngineServer, describe
from genrec.serving.http_errors import NotServed, error_response
from tests.conftest import HSTU_TINY as SPEC
from tests.conftest import TINY


@pytest.fixture(scope="module")
def ranker_server(hstu_dir):
    options = AppArgs(ranker={"model_dir": str(hstu_dir), "kv_budget_bytes": 16 << 20}).ranker.replica_options()
    server = EngineServer.func_or_class(str(hstu_dir), "cpu", options)
    yield server
    server._stopped.set()
    server.driver.shutdown()


def test_model_info_of_each_family(engine, tiny_dir, hstu_dir):
    qwen3 = describe(engine, str(tiny_dir), "cpu")
    assert (qwen3.family, qwen3.serves, qwen3.levels, qwen3.user_dim) == (
        "qwen3", ["retrieve", "score", "recommend"], TINY.levels, TINY.user_dim,
    )  # fmt: skip
    assert qwen3.tasks is None and qwen3.max_history_events is None
    ranker = describe(Engine.from_pretrained(hstu_dir), str(hstu_dir), "cpu")
    assert (ranker.family, ranker.serves, ranker.tasks) == ("hstu", ["rank"], list(SPEC.tasks))
    assert (ranker.catalog_items, ranker.max_history_events) == (SPEC.items, SPEC.max_positions - 1)
    assert ranker.levels is ranker.max_beam_width is ranker.max_prompt_tokens is ranker.user_dim is None


def declared(protocol) -> set[str]:
    """The members a family protocol declares, its bases' included."""
    bases = [c for c in protocol.__mro__ if Family in c.__mro__]
    return {name for c in bases for name in (*vars(c), *c.__annotations__) if not name.startswith("_")}


def test_each_family_has_every_member_the_seam_declares(engine, ranker):
    """The engine, its scheduler and runner and the servers read a family only through the protocol (no probing
    for an optional member): the decoder implements all of Generating, the ranker all of Family, and what only a
    generating family has is there in the ranker as "none" (no levels, no live catalog, no prompt)."""
    assert {"levels", "ops", "catalogs", "render_prompt", "capture_prefill", "describe"} <= declared(Family)
    assert declared(Generating) - declared(Family) == {"decode_forward", "generated", "max_children"}
    for family, protocol in ((engine.family, Generating), (ranker.family, Family)):
        assert sorted(name for name in declared(protocol) if not hasattr(family, name)) == [], family.name
    assert (engine.family.levels > 0, ranker.family.levels) == (True, 0)
    assert engine.live_catalog and not ranker.live_catalog and ranker.family.catalogs is None


def test_the_replica_ranks_as_the_engine_does_and_ignores_the_routing_key(ranker_server, hstu_dir):
    request = RankRequest(history=[Event(item_id="item-000001", action=1), Event(item_id="item-000002")],
                          candidates=["item-000003", "item-000004"])  # fmt: skip
    result, version = asyncio.run(ranker_server.rank(request, 10.0, routing_key="user:'u'"))
    (want,) = Engine.from_pretrained(hstu_dir, scheduler=SchedulerConfig(prefix_cache_bytes=0)).rank([request])
    assert version == ranker_server.info.version and result.history_events == 2
    for got, expected in zip(result.items, want.items, strict=True):
        assert got.scores == pytest.approx(expected.scores, abs=1e-5)
    assert ranker_server.stats()["metrics"]["requests"]["rank:ok"] == 1


def test_a_request_of_the_other_family_is_refused_by_the_replica(ranker_server):
    """The ingress sends each route to the deployment of its family (a 404 where the app has none: the HTTP
    tests); a replica handed another family's request refuses it as the client's mistake, before its engine
    queues anything."""
    with pytest.raises(InvalidRequestError, match="serves rank, not retrieve"):
        asyncio.run(ranker_server.retrieve(RetrieveRequest(prompt="user listened"), 10.0))
    metrics = ranker_server.stats()["metrics"]
    assert metrics["requests"]["retrieve:invalid"] == 1 and metrics["queue_depth"] == 0  # counted once, not queued


def test_not_served_is_a_404_and_survives_pickling():
    error = NotServed("retrieve", "hstu", ["rank"])
    back = pickle.loads(pickle.dumps(error))
    assert (type(back), str(back), back.__dict__) == (NotServed, str(error), error.__dict__)
    response = error_response(back)
    assert response.status_code == 404 and b'"not_served"' in response.body
