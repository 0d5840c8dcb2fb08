"""HSTU ranking through the engine: equal to the plain float64 reference, history cached across requests, the
same validation rules as the other kinds, and the engine picks the family from the model directory."""

import asyncio
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from genrec.api import Event, RankRequest, RetrieveRequest
from genrec.catalog.catalog import catalog_version
from genrec.engine import AsyncEngine, Engine, SchedulerConfig
from genrec.engine.pass_cost import PassCost
from genrec.engine.scheduler import Scheduler
from genrec.errors import InvalidRequestError
from genrec_bench.engine import plain_masked_forward, rank_request
from tests.conftest import HSTU_TINY as SPEC
from tests.hstu_reference import reference_rank

TOL = 1e-5


def history(rng: random.Random, n: int, start_time: float = 1e9) -> list[Event]:
    t, events = start_time, []
    for _ in range(n):
        t += rng.choice([None, 5.0, 300.0, 86400.0]) or 0.0
        action = rng.choice([None, 0, 1, 2])
        events.append(Event(item_id=f"item-{rng.randrange(SPEC.items):06d}", action=action, timestamp=t))
    return events


def candidates(rng: random.Random, n: int) -> list[str]:
    return [f"item-{rng.randrange(SPEC.items):06d}" for _ in range(n)]


def reference(ranker, hstu_dir, request: RankRequest):
    config = ranker.model.config
    params = load_file(str(hstu_dir / "model.safetensors"))
    rows = ranker.catalog.row_of
    buckets = config.time_buckets([e.timestamp for e in request.history])
    out = reference_rank(
        params,
        config,
        [rows(e.item_id) for e in request.history],
        [e.action for e in request.history],
        [rows(c) for c in request.candidates],
        buckets=[None if b == config.unknown_bucket else b for b in buckets],
    )
    return out.probs.numpy()


def probs(result, tasks) -> np.ndarray:
    return np.array([[item.scores[t] for t in tasks] for item in result.items])


@pytest.mark.parametrize("events,count", [(1, 1), (37, 9), (200, 64)])
def test_rank_equals_the_plain_masked_forward(ranker, hstu_dir, events, count):
    rng = random.Random(events)
    request = RankRequest(history=history(rng, events), candidates=candidates(rng, count))
    (result,) = ranker.rank([request])
    assert [i.item_id for i in result.items] == request.candidates and result.history_events == events
    assert np.abs(probs(result, SPEC.tasks) - reference(ranker, hstu_dir, request)).max() <= TOL
    assert result.catalog_version == catalog_version(hstu_dir / "genrec/catalog.parquet")  # its item index's


def test_a_candidates_scores_do_not_depend_on_the_others(ranker):
    rng = random.Random(3)
    events, pool = history(rng, 50), candidates(rng, 30)
    (full,) = ranker.rank([RankRequest(history=events, candidates=pool)])
    shuffled = pool[::-1][:17]
    (part,) = ranker.rank([RankRequest(history=events, candidates=shuffled)])
    by_item = {i.item_id: i.scores for i in full.items}
    for item in part.items:
        assert item.scores == pytest.approx(by_item[item.item_id], abs=1e-6)


def test_requests_batched_and_chunked_equal_each_alone(hstu_dir, ranker):
    rng = random.Random(4)
    requests = [RankRequest(history=history(rng, n), candidates=candidates(rng, c)) for n, c in ((5, 40), (90, 3))]
    small_passes = Engine.from_pretrained(hstu_dir, score_max_tokens=7, scheduler=SchedulerConfig(prefix_cache_bytes=0))
    together = small_passes.rank(requests)  # rows of both requests in passes of 7
    for request, got in zip(requests, together, strict=True):
        (alone,) = ranker.rank([request])
        assert np.abs(probs(got, SPEC.tasks) - probs(alone, SPEC.tasks)).max() <= 1e-6


def test_a_ranking_holds_its_history_in_the_pool_not_its_candidates(hstu_dir, ranker):
    """Candidate rows attend to the history and write nothing: many candidates fit a pool sized for the history, and
    two such rankings run side by side there."""
    rng = random.Random(8)
    requests = [RankRequest(history=history(rng, 100), candidates=candidates(rng, 1500)) for _ in range(2)]
    per_token = Scheduler(ranker.family, ranker.runner).per_token
    small = Engine.from_pretrained(
        hstu_dir, score_max_tokens=200, scheduler=SchedulerConfig(kv_budget_bytes=220 * per_token, prefix_cache_bytes=0)
    )
    scheduler = small.scheduler
    futures = [scheduler.submit(small.prepare(r)) for r in requests]
    scheduler.step()
    assert len(scheduler.running) == 2 and scheduler.budget.reserved == 200 * per_token
    while not scheduler.idle:
        scheduler.step()
    for future, request in zip(futures, requests, strict=True):
        (alone,) = ranker.rank([request])
        assert np.abs(probs(future.result(), SPEC.tasks) - probs(alone, SPEC.tasks)).max() <= 1e-6
    assert scheduler.budget.reserved == 0


def test_a_returning_users_history_is_reused_and_equals_a_cold_run(ranker, hstu_dir):
    scheduler = Scheduler(ranker.family, ranker.runner)  # prefix cache on
    rng = random.Random(5)
    events = history(rng, 100)
    reused = []
    for _ in range(4):  # each visit: 10 new events after the cached history
        events = events + history(rng, 10, start_time=events[-1].timestamp)
        request = RankRequest(
            history=events, candidates=candidates(rng, 12), tasks=["like", "click"], cache_scope="user-1"
        )  # reuse is within a cache scope
        before = scheduler.cache.stats.tokens_reused
        future = scheduler.submit(ranker.prepare(request))
        while not scheduler.idle:
            scheduler.step()
        warm = future.result()
        reused.append(scheduler.cache.stats.tokens_reused - before)
        assert list(warm.items[0].scores) == ["like", "click"]
        assert np.abs(probs(warm, ["click", "like"]) - reference(ranker, hstu_dir, request)[:, :2]).max() <= TOL
    assert reused[0] == 0 and all(r >= 96 for r in reused[1:])


def test_a_history_whose_pieces_cost_more_than_its_prefill_is_recomputed(hstu_dir):
    """The cost rule through the engine: the ranker costed as on CUDA, where each cached piece's attention calls
    cost more than this short history's prefill, reads nothing back and still equals the reference."""
    engine = Engine.from_pretrained(hstu_dir)
    engine.family.cost = PassCost.hstu(engine.model.config, "cuda")
    scheduler, rng = Scheduler(engine.family, engine.runner), random.Random(5)
    events = history(rng, 100)
    for _ in range(2):
        events = events + history(rng, 10, start_time=events[-1].timestamp)
        request = RankRequest(history=events, candidates=candidates(rng, 12), cache_scope="user-1")
        future = scheduler.submit(engine.prepare(request))
        while not scheduler.idle:
            scheduler.step()
        assert np.abs(probs(future.result(), SPEC.tasks) - reference(engine, hstu_dir, request)).max() <= TOL
    assert scheduler.cache.stats.tokens_reused == 0 and scheduler.cache.bytes > 0  # kept, but not worth reading


def test_rank_requests_are_validated_naming_the_field(ranker):
    rng = random.Random(6)
    good = RankRequest(history=history(rng, 3), candidates=candidates(rng, 2))
    cases = {
        "history[1].item_id": good.model_copy(update={"history": [good.history[0], Event(item_id="nope")]}),
        "history[0].action": good.model_copy(update={"history": [Event(item_id="item-000001", action=3)]}),
        "candidates[1]": good.model_copy(update={"candidates": ["item-000002", "missing"]}),
        "tasks[0]": good.model_copy(update={"tasks": ["watch"]}),
        "history:": good.model_copy(update={"history": good.history * 200}),
    }
    for field, request in cases.items():
        with pytest.raises(InvalidRequestError, match=field.replace("[", r"\[").replace("]", r"\]")):
            ranker.rank([request])
    unchecked = Event.model_construct(item_id="item-000001", action=-1)  # a caller that skipped the schema
    with pytest.raises(InvalidRequestError, match=r"history\[0\]\.action: -1 is not an action"):
        ranker.rank([good.model_copy(update={"history": [unchecked]})])
    with pytest.raises(ValueError, match="timestamp"):
        Event(item_id="item-000001", timestamp=float("nan"))
    with pytest.raises(InvalidRequestError, match="serves rank, not retrieve"):
        ranker.retrieve([RetrieveRequest(prompt_token_ids=[1, 2])])


def test_skipped_unknown_candidates_leave_the_known_ranked_as_alone_and_the_history_still_checked(ranker):
    """unknown_candidates 'skip' (the funnel's rule): the unknown ones left out, the known ones scored as a request
    of them alone would; none known is an empty result, not an error; a bad history is refused all the same."""
    rng = random.Random(8)
    events, known = history(rng, 20), candidates(rng, 4)
    mixed = ["nope-1", known[0], known[1], "nope-2", known[2], known[3]]
    (alone,) = ranker.rank([RankRequest(history=events, candidates=known)])
    (skipped,) = ranker.rank([RankRequest(history=events, candidates=mixed, unknown_candidates="skip")])
    assert [i.item_id for i in skipped.items] == known
    assert probs(skipped, SPEC.tasks) == pytest.approx(probs(alone, SPEC.tasks), abs=1e-6)
    with pytest.raises(InvalidRequestError, match=r"candidates\[0\]"):  # the default refuses
        ranker.rank([RankRequest(history=events, candidates=mixed)])
    none = RankRequest(history=events, candidates=["nope-1", "nope-2"], unknown_candidates="skip", request_id="r")
    (empty,) = ranker.rank([none])
    assert (empty.items, empty.history_events, empty.request_id) == ([], 20, "r")
    assert empty.catalog_version == ranker.catalog.version
    bad = none.model_copy(update={"history": [Event(item_id="no-such-item")]})
    with pytest.raises(InvalidRequestError, match=r"history\[0\].item_id"):
        ranker.rank([bad])


def test_a_qwen3_engine_refuses_rank_requests(engine):
    request = RankRequest(history=[Event(item_id="item-000001")], candidates=["item-000002"])
    with pytest.raises(InvalidRequestError, match="not rank"):
        engine.rank([request])


def test_the_async_engine_ranks_concurrent_requests(ranker, hstu_dir):
    rng = random.Random(7)
    requests = [RankRequest(history=history(rng, 20 + i), candidates=candidates(rng, 5)) for i in range(6)]
    async_engine = AsyncEngine(ranker)

    async def all_at_once():
        return await asyncio.gather(*(async_engine.rank(r) for r in requests))

    try:
        results = asyncio.run(all_at_once())
    finally:
        async_engine.shutdown()
    for request, result in zip(requests, results, strict=True):
        assert np.abs(probs(result, SPEC.tasks) - reference(ranker, hstu_dir, request)).max() <= TOL


class OneDevice(TorchDispatchMode):
    """Fails any op whose tensors (one-element host scalars aside) lie on more than one device; moves are allowed."""

    MOVES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor) and t.dim()]
        devices = {t.device for t in tensors}
        if func not in self.MOVES and len(devices) > 1:
            raise AssertionError(f"{func} mixes devices {sorted(map(str, devices))}")
        return func(*args, **(kwargs or {}))


def test_the_rank_benchs_plain_forward_runs_on_the_models_device(hstu_dir):
    """`bench rank --device cuda` failed in this baseline (its indices stayed on the host). The model on the meta
    device stands in for a GPU here: an op mixing a host tensor with the model's fails."""
    engine = Engine.from_pretrained(hstu_dir, scheduler=SchedulerConfig(prefix_cache_bytes=0))
    engine.model.to("meta")
    with OneDevice():
        out = plain_masked_forward(engine, rank_request(engine, 30, 5))
    assert out.device.type == "meta" and out.shape == (5, len(SPEC.tasks))
