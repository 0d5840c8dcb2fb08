"""No host synchronisation inside a step: whole batches and scheduler steps run under `no_sync`.

On CUDA each of these calls would stall the launch queue; the guard sees the calls themselves, so the
property holds on the CPU-only CI too. Results come back through the one named fetch point.
"""

import pytest
import torch

from genrec.api import Candidate, RecommendRequest, RetrieveRequest, ScoreRequest
from genrec.engine.scheduler import Scheduler, SchedulerConfig
from tests.conftest import random_prompt
from tests.sync_guard import SyncError, no_sync


def test_the_guard_catches_what_would_sync():
    t = torch.arange(5)
    for syncing in (
        lambda: t.sum().item(),
        lambda: t.tolist(),
        lambda: torch.isin(t, t),
        lambda: t[t > 2],
        lambda: bool(t.any()),
        lambda: torch.tensor([1], device="cpu"),
        lambda: t.nonzero(),
    ):
        with pytest.raises(SyncError), no_sync():
            syncing()
    with no_sync():
        (t * 2).topk(2)  # plain device work passes


def requests(engine, rng):
    items = engine.catalog.item_ids
    cands = [Candidate(item_id=i) for i in items[:5]] + [Candidate(token_ids=[3, 4, 5])]
    embedding = [0.1] * engine.family.projector.user_dim if engine.family.projector is not None else None
    user_prompt = (
        [engine.family.placeholder_id] + random_prompt(engine, 20, rng) if embedding else random_prompt(engine, 20, rng)
    )
    return [
        RetrieveRequest(prompt_token_ids=random_prompt(engine, 30, rng), beam_width=7, exclude_item_ids=items[:4]),
        RetrieveRequest(prompt_token_ids=user_prompt, beam_width=3, user_embedding=embedding),
        ScoreRequest(prompt_token_ids=random_prompt(engine, 25, rng), candidates=cands),
        RecommendRequest(
            prompt_token_ids=random_prompt(engine, 18, rng), beam_width=5, candidates=cands, exclude_item_ids=items[1:3]
        ),
        RecommendRequest(
            prompt_token_ids=random_prompt(engine, 19, rng), beam_width=4, candidates=cands, rank_by="joint"
        ),
    ]


def test_engine_batches_run_without_a_sync(engine, rng):
    retrieve, personal, score, *recommend = requests(engine, rng)
    with no_sync():
        got = engine.retrieve([retrieve, personal]), engine.score([score]), engine.recommend(recommend)
    assert got[0][0].items and got[0][1].items and got[1][0].scores and got[2][0].items and got[2][1].items
    assert got[0] == engine.retrieve([retrieve, personal])  # the same results outside the guard


def test_scheduler_steps_run_without_a_sync(engine, rng):
    scheduler = Scheduler(engine.family, engine.runner, SchedulerConfig(prefill_tokens_per_step=16))
    batch = requests(engine, rng)
    futures = [scheduler.submit(engine.prepare(r)) for r in batch + batch[:1]]  # the repeat hits the cache
    with no_sync():
        while not scheduler.idle:
            scheduler.step()
    results = [f.result() for f in futures]  # every request finished, none failed
    assert results[0].items and results[2].scores and results[3].items and results[4].items
    assert [i.item_id for i in futures[0].result().items] == [i.item_id for i in futures[-1].result().items]
