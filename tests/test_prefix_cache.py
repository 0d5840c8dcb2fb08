"""Context that outlives a request: a returning user's prompt reuses its cached prefix and equals a cold run.

The cold engine is the session's (no prefix cache); the warm scheduler keeps prefixes across requests. Reuse is
within a cache scope (tests/test_cache_scope.py): a returning user's requests here carry the user's scope.
"""

import numpy as np
import pytest
import torch

from genrec.api import Candidate, RecommendRequest, RetrieveRequest, ScoreRequest
from genrec.engine.prefix_cache import BLOCK, HostTier, PrefixCache, block_keys
from genrec.engine.scheduler import Scheduler, SchedulerConfig
from genrec.model.kv_pool import MAX_SPANS, ContextKV
from genrec.model.tokenizer import USER_TOKEN
from tests.conftest import random_prompt

USER = "user-1"  # the returning user's cache scope


def run(scheduler, engine, request):
    future = scheduler.submit(engine.prepare(request))
    while not scheduler.idle:
        scheduler.step()
    return future.result()


def assert_equal(warm, cold, tol=1e-4):
    if hasattr(warm, "scores"):
        assert [s.item_id for s in warm.scores] == [s.item_id for s in cold.scores]
        assert np.allclose([s.logprob for s in warm.scores], [s.logprob for s in cold.scores], atol=tol)
        return
    assert [i.item_id for i in warm.items] == [i.item_id for i in cold.items]
    for field in ("logprob", "score_logprob", "code_logprob"):
        w = [getattr(i, field) for i in warm.items if hasattr(i, field)]
        c = [getattr(i, field) for i in cold.items if hasattr(i, field)]
        assert np.allclose(np.asarray(w, dtype=float), np.asarray(c, dtype=float), atol=tol, equal_nan=True)


def cold(engine, request):
    return getattr(engine, type(request).__name__.removesuffix("Request").lower())([request])[0]


def returning_user(engine, rng, start=70, appends=(9, 23, 1, 40, 16, 5)):
    """A history that grows by a few events at a time: each prompt is the previous one plus new tokens."""
    prompt = random_prompt(engine, start, rng)
    yield prompt
    for n in appends:
        prompt = prompt + random_prompt(engine, n, rng)
        yield prompt


@pytest.mark.parametrize("kind", ["retrieve", "score", "recommend"])
def test_a_returning_user_reuses_the_cached_prefix_and_equals_a_cold_run(arch_engine, rng, kind):
    engine = arch_engine  # each decoder architecture's
    scheduler = Scheduler(engine.family, engine.runner)  # prefix cache on (the default)
    cands = [Candidate(item_id=i) for i in engine.catalog.item_ids[:6]] + [Candidate(text="news")]
    make = {
        "retrieve": lambda p: RetrieveRequest(prompt_token_ids=p, beam_width=8, cache_scope=USER),
        "score": lambda p: ScoreRequest(prompt_token_ids=p, candidates=cands, cache_scope=USER),
        "recommend": lambda p: RecommendRequest(
            prompt_token_ids=p, beam_width=5, candidates=cands, rank_by="joint", cache_scope=USER
        ),
    }[kind]
    reused = []
    for prompt in returning_user(engine, rng):
        before = scheduler.cache.stats.tokens_reused
        assert_equal(run(scheduler, engine, make(prompt)), cold(engine, make(prompt)))
        reused.append(scheduler.cache.stats.tokens_reused - before)
    assert reused[0] == 0 and all(r > 0 for r in reused[1:])
    assert all(r % BLOCK == 0 and r <= len(p) - 1 for r, p in zip(reused, returning_user(engine, rng), strict=False))


def test_reuse_holds_at_most_max_spans_pieces_and_recomputes_the_small_tail(engine, rng):
    scheduler = Scheduler(engine.family, engine.runner)
    spans = []
    original = scheduler.budget.admit

    def recording(own, rest, prefix):
        spans.append(len(prefix))
        return original(own, rest, prefix)

    scheduler.budget.admit = recording
    for prompt in returning_user(engine, rng, start=40, appends=(20,) * 8):
        assert_equal(
            run(scheduler, engine, RetrieveRequest(prompt_token_ids=prompt, beam_width=6, cache_scope=USER)),
            cold(engine, RetrieveRequest(prompt_token_ids=prompt, beam_width=6)),
        )
    assert max(spans) == MAX_SPANS - 1 and spans[-1] >= 1


def test_warm_equals_cold_with_evictions_in_between(engine, rng):
    per_token = Scheduler(engine.family, engine.runner, SchedulerConfig(prefix_cache_bytes=0)).per_token
    scheduler = Scheduler(
        engine.family, engine.runner, SchedulerConfig(prefix_cache_bytes=per_token * 200)
    )  # room for a few entries
    users = [list(returning_user(engine, rng, start=60, appends=(17, 30))) for _ in range(3)]
    for step in range(3):  # users take turns: their entries push each other out
        for user, prompts in enumerate(users):
            request = RetrieveRequest(prompt_token_ids=prompts[step], beam_width=6, cache_scope=f"user-{user}")
            assert_equal(run(scheduler, engine, request), cold(engine, request))
    stats = scheduler.cache.stats
    assert stats.evictions > 0 and stats.hits > 0
    assert scheduler.cache.bytes <= per_token * 200


def test_a_soft_token_ties_later_blocks_to_its_embedding(engine, rng):
    scheduler = Scheduler(engine.family, engine.runner)
    user = engine.family.tokenizer.convert_tokens_to_ids(USER_TOKEN)
    prompt = random_prompt(engine, 60, rng)
    prompt[20] = user  # in block 1: block 0 is shared by every embedding, blocks 1.. are not
    a, b = (torch.randn(engine.family.projector.user_dim, generator=rng).tolist() for _ in range(2))
    longer = prompt + random_prompt(engine, 10, rng)
    request = lambda p, v: RetrieveRequest(  # noqa: E731
        prompt_token_ids=p, user_embedding=v, beam_width=6, cache_scope=USER
    )
    for tokens, vector, reused in ((prompt, a, 0), (longer, b, BLOCK), (longer, a, 48)):
        before = scheduler.cache.stats.tokens_reused
        assert_equal(run(scheduler, engine, request(tokens, vector)), cold(engine, request(tokens, vector)))
        assert scheduler.cache.stats.tokens_reused - before == reused


def test_an_edit_in_the_middle_reuses_only_the_blocks_before_it(engine, rng):
    scheduler = Scheduler(engine.family, engine.runner)
    prompt = random_prompt(engine, 90, rng)
    run(scheduler, engine, RetrieveRequest(prompt_token_ids=prompt, beam_width=4, cache_scope=USER))
    edited = list(prompt)
    edited[40] = (edited[40] + 1) % int(engine.family.trie.token[0].min())  # block 2 (tokens 32-47) changes
    request = RetrieveRequest(prompt_token_ids=edited + random_prompt(engine, 5, rng), beam_width=4, cache_scope=USER)
    before = scheduler.cache.stats.tokens_reused
    assert_equal(run(scheduler, engine, request), cold(engine, request))
    assert scheduler.cache.stats.tokens_reused - before == 2 * BLOCK


def test_block_keys_are_a_chain_salted_by_model_version_and_embedding():
    ids = np.arange(50)
    keys = block_keys(ids, b"v1", None, None)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert block_keys(ids, b"v2", None, None)[0] != keys[0]  # another model version: never a hit
    changed = ids.copy()
    changed[17] += 1
    other = block_keys(changed, b"v1", None, None)
    assert other[0] == keys[0] and other[1] != keys[1] and other[2] != keys[2]  # the chain carries the edit
    with_soft = block_keys(ids, b"v1", 20, [0.5, 0.25])
    assert with_soft[0] == keys[0] and with_soft[1] != keys[1]
    assert block_keys(ids, b"v1", 20, [0.5, 0.25]) == with_soft
    assert block_keys(ids, b"v1", 20, [0.5, 0.26])[1] != with_soft[1]


def cache_with_entries(engine, sizes, capacity_tokens):
    """A PrefixCache over a fresh pool holding one entry per size (tokens), each from its own prompt."""
    pool = engine.runner.new_pool(4096)
    cache = PrefixCache(capacity_tokens * pool.bytes_per_token, protected_share=0.5)
    keys = []
    for i, n in enumerate(sizes):
        ctx = ContextKV(pool.reserve(n))
        ctx.length = n
        k = block_keys(np.full(n, i), b"", None, None)
        cache.insert(k, ctx)
        ctx.release()  # the request ends: the cache's hold is the last
        keys.append(k)
    return pool, cache, keys


def test_eviction_is_by_bytes_and_never_takes_an_entry_in_use(engine):
    pool, cache, keys = cache_with_entries(engine, [32, 48, 16], capacity_tokens=96)
    assert cache.bytes == 96 * pool.bytes_per_token and pool.used == 96
    held = cache.lookup(keys[0], 10)  # a running request reads entry 0
    assert [p.length for p in held] == [32]
    assert cache.evict_one() and cache.evict_one()  # entries 1 and 2 go; 0 is in use
    assert not cache.evict_one() and pool.used == 32
    for piece in held:
        piece.extent.release()
    assert cache.evict_one() and pool.used == 0 and cache.bytes == 0


def test_one_off_prompts_do_not_flush_a_returning_users_prefix(engine):
    """Segmented LRU: a reused entry is protected; a stream of one-off prompts evicts each other first."""
    pool, cache, keys = cache_with_entries(engine, [32], capacity_tokens=96)
    for piece in cache.lookup(keys[0], 10):  # the user returns once: protected
        piece.extent.release()
    for i in range(10):  # one-off prompts, each 32 tokens, never seen again
        ctx = ContextKV(pool.reserve(32))
        ctx.length = 32
        cache.insert(block_keys(np.full(32, 100 + i), b"", None, None), ctx)
        ctx.release()
    assert [p.length for p in cache.lookup(keys[0], 10)] == [32]  # still there
    assert cache.bytes <= 96 * pool.bytes_per_token and cache.stats.evictions >= 8


def test_an_evicted_prefix_spills_to_the_host_tier_and_comes_back_on_a_hit(engine, rng):
    """A second tier (host memory; sized explicitly here, off by default): an entry evicted from the pool is kept
    there and copied back when its user returns; the result still equals a cold run."""
    per_token = Scheduler(engine.family, engine.runner, SchedulerConfig(prefix_cache_bytes=0)).per_token
    config = SchedulerConfig(prefix_cache_bytes=per_token * 100, host_cache_bytes=per_token * 1000)
    scheduler = Scheduler(engine.family, engine.runner, config)
    users = [list(returning_user(engine, rng, start=80, appends=(12,))) for _ in range(3)]
    for user, prompts in enumerate(users):  # three first visits: 80 tokens each, only one fits the pool's share
        run(scheduler, engine, RetrieveRequest(prompt_token_ids=prompts[0], beam_width=6, cache_scope=f"user-{user}"))
    assert scheduler.cache.stats.spills >= 2
    before = scheduler.cache.stats.tokens_reused
    request = RetrieveRequest(prompt_token_ids=users[0][1], beam_width=6, cache_scope="user-0")  # long evicted
    assert_equal(run(scheduler, engine, request), cold(engine, request))
    snapshot = scheduler.cache.snapshot()
    assert snapshot["restores"] >= 1 and scheduler.cache.stats.tokens_reused - before == 80
    assert SchedulerConfig().host_cache_bytes == 0  # off unless sized


@pytest.mark.timeout(60)  # the defect this guards against spun inside one step, forever
def test_a_prefix_back_from_the_host_waits_beside_a_running_request_instead_of_cycling(engine, rng):
    """A returning user's prefix, spilled to the host tier, comes back while another request holds the rest of the
    pool: the user waits for that request, then reuses the prefix. (Admission used to copy the entry back, fail,
    evict that same entry to the host again and retry, forever.)"""
    per_token = Scheduler(engine.family, engine.runner, SchedulerConfig(prefix_cache_bytes=0)).per_token
    pool = per_token * 400
    config = SchedulerConfig(kv_budget_bytes=pool, prefix_cache_bytes=pool, host_cache_bytes=per_token * 1000)
    scheduler = Scheduler(engine.family, engine.runner, config)
    first = random_prompt(engine, 200, rng)
    run(scheduler, engine, RetrieveRequest(prompt_token_ids=first, beam_width=1, cache_scope=USER))
    run(scheduler, engine, RetrieveRequest(prompt_token_ids=random_prompt(engine, 300, rng), beam_width=1))
    assert scheduler.cache.stats.spills == 1  # the user's prefix is on the host now
    holding = RetrieveRequest(prompt_token_ids=random_prompt(engine, 160, rng), beam_width=5)  # 190 of the 400
    returning = RetrieveRequest(prompt_token_ids=first + random_prompt(engine, 10, rng), beam_width=1, cache_scope=USER)
    futures = [scheduler.submit(engine.prepare(r)) for r in (holding, returning)]
    while not scheduler.idle:
        scheduler.step()
    for future, request in zip(futures, (holding, returning), strict=True):
        assert_equal(future.result(), cold(engine, request))
    snapshot = scheduler.cache.snapshot()
    assert snapshot["restores"] == 1 and scheduler.cache.stats.tokens_reused == 192  # its 12 whole blocks, once


def test_a_waiting_users_blocks_beyond_its_readable_pieces_stay_on_the_host(engine, rng):
    """A user with four cached pieces returns while another request holds the pool (which sent all four to the
    host): a prefix reads three pieces at most, so those three come back once, when there is room, and the fourth
    stays on the host."""
    per_token = Scheduler(engine.family, engine.runner, SchedulerConfig(prefix_cache_bytes=0)).per_token
    config = SchedulerConfig(kv_budget_bytes=per_token * 500, prefix_cache_bytes=per_token * 200,
                             host_cache_bytes=per_token * 4000, prefill_tokens_per_step=4)  # fmt: skip
    scheduler = Scheduler(engine.family, engine.runner, config)
    prompt = random_prompt(engine, 32, rng)
    for visit in range(4):  # each visit adds two blocks: four entries
        run(scheduler, engine, RetrieveRequest(prompt_token_ids=prompt, beam_width=1, cache_scope=USER))
        prompt = prompt + random_prompt(engine, 32, rng) if visit < 3 else prompt
    other = RetrieveRequest(prompt_token_ids=random_prompt(engine, 100, rng), beam_width=1, cache_scope="user-2")
    run(scheduler, engine, other)  # its entry pushes the fourth piece out, to the host
    holding = scheduler.submit(engine.prepare(RetrieveRequest(prompt_token_ids=random_prompt(engine, 300, rng))))
    scheduler.step()  # it holds most of the pool, prefilled 4 tokens a step
    returning = RetrieveRequest(
        prompt_token_ids=prompt + random_prompt(engine, 32, rng), beam_width=6, cache_scope=USER
    )
    future = scheduler.submit(engine.prepare(returning))
    while not scheduler.idle:
        scheduler.step()
    assert holding.result() and scheduler.cache.snapshot()["restores"] == MAX_SPANS - 1
    assert_equal(future.result(), cold(engine, returning))


def test_host_memory_refused_drops_the_evicted_entry_and_gives_its_tokens_back(engine):
    """Pinned memory beyond what the machine gives (host_cache_bytes set too high) fails the spill: the evicted
    entry is dropped as by a full tier, never leaked, and the eviction goes on."""

    class RefusingHost(HostTier):
        def spill(self, keys, extent, tokens):
            raise RuntimeError("CUDA error: out of memory (pinned host allocation)")

    pool = engine.runner.new_pool(4096)
    cache = PrefixCache(64 * pool.bytes_per_token, host=RefusingHost(1 << 30, pool))
    ctx = ContextKV(pool.reserve(32))
    ctx.length = 32
    cache.insert(block_keys(np.full(32, 7), b"", None, None), ctx)
    ctx.release()
    assert cache.evict_one() and pool.used == 0 and cache.bytes == 0 and cache.stats.spills == 0


def test_warm_and_cold_prompts_prefilled_in_one_pass_equal_their_cold_runs(engine, rng):
    """One packed prefill pass mixing a chunk with a reused prefix and chunks without: each equals a cold run."""
    scheduler = Scheduler(engine.family, engine.runner)
    returning = list(returning_user(engine, rng, start=64, appends=(9,)))
    run(scheduler, engine, RetrieveRequest(prompt_token_ids=returning[0], beam_width=5, cache_scope=USER))
    requests = [
        RetrieveRequest(prompt_token_ids=returning[1], beam_width=5, cache_scope=USER),  # warm: 64 tokens reused
        RetrieveRequest(prompt_token_ids=random_prompt(engine, 40, rng), beam_width=5),  # cold
        RetrieveRequest(prompt_token_ids=random_prompt(engine, 23, rng), beam_width=5),  # cold
    ]
    futures = [scheduler.submit(engine.prepare(r)) for r in requests]
    while not scheduler.idle:
        scheduler.step()
    assert scheduler.cache.stats.tokens_reused == 64
    for request, future in zip(requests, futures, strict=True):
        assert_equal(future.result(), cold(engine, request))


def chained_entries(engine, runs, gain):
    """A cache (gain rule `gain`) holding one prompt's blocks as consecutive entries of `runs` tokens each: what a
    returning user's visits leave, read back as one piece per entry. Returns the cache and the prompt's keys."""
    pool = engine.runner.new_pool(4096)
    cache = PrefixCache(4096 * pool.bytes_per_token)
    keys, prefix = block_keys(np.arange(sum(runs) + BLOCK), b"", None, None), []
    for n in runs:
        ctx = ContextKV(pool.reserve(n), prefix)
        ctx.length += n
        cache.insert(keys, ctx)
        prefix = cache.lookup(keys, ctx.length // BLOCK)  # the next visit reads all so far (a retained hold each)
        ctx.release()
    for piece in prefix:
        piece.extent.release()
    cache.gain = gain
    return cache, keys


def test_reuse_reads_only_the_pieces_that_gain_more_than_they_cost(engine):
    """`gain(tokens, pieces)` weighs a prefix's saved prefill against its pieces' overhead; without one (or where
    pieces cost nothing) the longest prefix is read, as it always was."""
    runs = [64, 16, 32]
    for gain, want in (
        (None, [64, 16, 32]),
        (lambda tokens, pieces: tokens, [64, 16, 32]),
        (lambda tokens, pieces: tokens - 20 * pieces, [64, 16, 32]),  # the 2nd alone does not pay, with the 3rd it does
        (lambda tokens, pieces: tokens - 40 * pieces, [64]),  # the 2nd (16) and 3rd (32) cost more than they save
        (lambda tokens, pieces: tokens - 100 * pieces, []),  # nothing pays: all recomputed
    ):
        cache, keys = chained_entries(engine, runs, gain)
        pieces = cache.lookup(keys, len(keys))
        assert [p.length for p in pieces] == want, gain
        held = {id(p.extent): p.extent.holders for p in pieces}
        assert all(h == 2 for h in held.values())  # the cache's hold and the caller's, on what it reads only
        assert cache.evict_one() == (len(pieces) < len(runs))  # an entry not read stays evictable


def test_the_rankers_piece_cost_follows_the_device(engine):
    """The rule's inputs: a piece costs the tiny HSTU's passes nothing on the CPU (where the longest prefix is read,
    as always), and on CUDA more than a 2,000-event history's whole prefill (an H200 recomputed it faster than it
    read it in pieces); a long history pays there too. A decoder's pieces cost nothing (its calls are fixed)."""
    from genrec.engine.pass_cost import PassCost
    from genrec.testing.tiny import hstu_preset

    config = hstu_preset("tiny").config()
    cpu, cuda = PassCost.hstu(config, "cpu"), PassCost.hstu(config, "cuda")
    assert cpu.piece_cost == 0 and cpu.reuse_gain(BLOCK, 1) > 0
    assert cpu.reuse_gain(2000, 3) > cpu.reuse_gain(2000 - BLOCK, 2)  # on the CPU the longest prefix gains most
    assert cuda.reuse_gain(2000, 1) < 0 < cuda.reuse_gain(8000, 1)
    assert cuda.reuse_gain(8000, 1) > cuda.reuse_gain(8000 + BLOCK, 2)  # one more small piece costs more than it saves
    assert engine.family.cost.piece_cost == 0
