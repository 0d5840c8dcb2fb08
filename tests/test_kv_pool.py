"""The KV pool: first-fit extents with coalescing, contexts as views of it, admission by real pool space."""

import pytest
import torch

from genrec.api import RetrieveRequest
from genrec.engine.scheduler import Scheduler, SchedulerConfig
from genrec.model.kv_pool import ContextKV, ExtentAllocator, KVPool
from tests.conftest import random_prompt


def test_first_fit_reuses_holes_and_coalesces_to_one_extent():
    a = ExtentAllocator(100)
    x, y, z = a.allocate(30), a.allocate(30), a.allocate(30)
    assert (x, y, z) == (0, 30, 60) and a.allocate(11) is None and a.largest == 10
    a.release(y, 30)
    assert a.allocate(31) is None  # 40 tokens free, but no 31 in one piece
    assert a.allocate(20) == 30  # first fit: the hole
    a.release(30, 20)
    a.release(x, 30)
    a.release(z, 30)
    assert a.free == [(0, 100)] and a.used == 0
    with pytest.raises(RuntimeError, match="released twice"):
        a.release(0, 10)


def test_a_context_is_a_view_of_its_pool_and_comes_back_when_its_last_holder_releases(engine):
    pool = engine.runner.new_pool(64)
    first, second = pool.context(20), pool.context(30)
    assert (first.extent.start, second.extent.start, pool.used) == (0, 20, 50)
    first.length = 5
    k, _ = first.layer(1)
    assert k.shape == (engine.model.config.num_key_value_heads, 5, engine.model.config.head_dim)
    assert k.data_ptr() == pool.k[1, 0].data_ptr()  # a view: nothing copied
    second.extent.retain()
    second.release()
    assert pool.used == 50  # one holder left
    second.extent.release()
    first.release()
    assert pool.used == 0 and pool._extents.largest == 64
    assert pool.context(65) is None


def test_pooled_prefill_writes_the_same_kv_as_a_private_context(engine, rng):
    ids = torch.tensor(random_prompt(engine, 17, rng))
    model = engine.model
    alone = ContextKV.allocate(model.config, 17, "cpu", model.dtype)
    want = model.prefill(model.embed(ids), alone)
    pool = KVPool(model.config, 50, "cpu", model.dtype)
    pool.context(9)  # something before it: the context sits at an offset
    ctx = pool.context(17)
    got = model.prefill(model.embed(ids), ctx)
    assert ctx.extent.start == 9 and torch.equal(got, want)
    assert torch.equal(ctx.k, alone.k) and torch.equal(ctx.v, alone.v)


def test_admission_takes_real_pool_space_and_everything_comes_back(engine, rng):
    requests = [
        RetrieveRequest(prompt_token_ids=random_prompt(engine, n, rng), beam_width=8, cache_scope=f"user-{n}")
        for n in (30, 12, 40)
    ]  # each of a user: its prompt is cached (a request without a scope is private: nothing of it is cached)
    prepared = [engine.prepare(r) for r in requests]
    tokens = [p.kv_tokens for p in prepared]
    scheduler = Scheduler(
        engine.family,
        engine.runner,
        SchedulerConfig(kv_budget_bytes=Scheduler(engine.family, engine.runner).per_token * (tokens[0] + tokens[1])),
    )
    pool = scheduler.budget.pool
    futures = [scheduler.submit(p) for p in prepared]
    scheduler.step()
    assert pool.used == tokens[0] + tokens[1] and len(scheduler.waiting) == 1  # the third waits for space
    while not scheduler.idle:
        scheduler.step()
    assert pool.used * pool.bytes_per_token == scheduler.cache.bytes  # what stays is the prefix cache's
    scheduler.cache.clear()
    assert pool.used == 0 and pool._extents.largest == pool.tokens and scheduler.budget.reserved == 0
    for request, future in zip(requests, futures, strict=True):
        assert [i.item_id for i in future.result().items] == [i.item_id for i in engine.retrieve([request])[0].items]


def test_cached_prompts_hold_pool_space_until_evicted_for_a_request_that_does_not_fit(engine, rng):
    small = RetrieveRequest(prompt_token_ids=random_prompt(engine, 20, rng), beam_width=4, cache_scope="user-1")
    big = RetrieveRequest(prompt_token_ids=random_prompt(engine, 60, rng), beam_width=4, cache_scope="user-2")
    need = engine.prepare(big).kv_tokens
    per_token = Scheduler(engine.family, engine.runner).per_token
    budget = per_token * need
    scheduler = Scheduler(
        engine.family, engine.runner, SchedulerConfig(kv_budget_bytes=budget, prefix_cache_bytes=budget)
    )
    pool = scheduler.budget.pool
    first = scheduler.submit(engine.prepare(small))
    while not scheduler.idle:
        scheduler.step()
    assert pool.used == 20 and scheduler.budget.reserved == 0  # the cached prompt, no job
    second = scheduler.submit(engine.prepare(big))  # needs the whole pool: the cache gives its prompt up
    while not scheduler.idle:
        scheduler.step()
    assert second.result().items and first.result().items
    assert scheduler.cache.snapshot()["entries"] == 1 and pool.used == 60  # now the big prompt is the cached one
