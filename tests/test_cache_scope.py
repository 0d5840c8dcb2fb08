"""Prefix-cache isolation: cached blocks are reachable only within a request's scope (its cache_scope; over HTTP, by
default, its user's), except those wholly inside its declared shared prefix; a request without a scope is private.

The keys first (genrec.engine.prefix_cache.block_keys), then both families on a real engine with the cache on,
read through the cache's counters (tokens reused), never through wall time: the timing side channel of issue 29
is closed when another user's guess, right or wrong, reuses nothing. The ingress's scope of an HTTP body last.
"""

import random

import numpy as np
import pytest

from genrec.api import Event, RankRequest, RetrieveRequest, ScoreRequest
from genrec.engine.prefix_cache import BLOCK, Scope, block_keys
from genrec.engine.scheduler import Scheduler
from genrec.serving.schemas import RankBody, RecommendBody, RetrieveBody, ScoreBody, cache_scope
from tests.conftest import HSTU_TINY, random_prompt

IDS = np.arange(100)  # six whole blocks and four tokens


# -- the keys ---------------------------------------------------------------------------------------------------


def test_the_same_content_in_another_scope_shares_no_key_and_in_the_same_scope_every_key():
    alice = block_keys(IDS, b"v1", None, None, Scope("alice"))
    assert len(alice) == 6 and alice == block_keys(IDS, b"v1", None, None, Scope("alice"))
    bob = block_keys(IDS, b"v1", None, None, Scope("bob"))
    assert len(bob) == 6 and not set(alice) & set(bob)
    assert not set(alice) & set(block_keys(IDS, b"v1", None, None))  # nor with the content-only keys
    assert not set(alice) & set(block_keys(IDS, b"v2", None, None, Scope("alice")))  # another model version


def test_blocks_wholly_inside_the_shared_prefix_are_public_and_every_later_one_scoped():
    public = block_keys(IDS, b"v1", None, None)  # content alone
    alice = block_keys(IDS, b"v1", None, None, Scope("alice", shared=40))  # blocks 0, 1 whole; block 2 only partly
    bob = block_keys(IDS, b"v1", None, None, Scope("bob", shared=40))
    assert alice[:2] == bob[:2] == public[:2]
    assert not set(alice[2:]) & set(bob[2:]) and not set(alice[2:]) & set(public)
    assert block_keys(IDS, b"v1", None, None, Scope("alice", shared=10**9)) == public  # beyond the prompt: all


def test_a_private_request_has_keys_for_its_shared_blocks_only():
    assert block_keys(IDS, b"v1", None, None, Scope(None)) == []
    shared = block_keys(IDS, b"v1", None, None, Scope(None, shared=3 * BLOCK + 5))
    assert shared == block_keys(IDS, b"v1", None, None)[:3]
    assert shared == block_keys(IDS, b"v1", None, None, Scope("alice", shared=3 * BLOCK))[:3]


def test_a_soft_token_still_ties_later_blocks_to_its_embedding_within_a_scope():
    ids = np.arange(50)
    a = block_keys(ids, b"v1", 20, [0.5, 0.25], Scope("alice"))  # the placeholder (20) is in block 1
    b = block_keys(ids, b"v1", 20, [0.5, 0.26], Scope("alice"))
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]
    shared = block_keys(ids, b"v1", 20, [0.5, 0.25], Scope("bob", shared=32))  # a public block holding it
    assert shared[:2] == block_keys(ids, b"v1", 20, [0.5, 0.25])[:2] and shared[2] != a[2]


def test_every_request_kind_carries_its_scope():
    prompt = {"prompt_token_ids": [5, 6], "cache_scope": "tenant-a", "shared_prefix": 16}
    history = {"history": [Event(item_id="item-000001")], "candidates": ["item-000002"]}
    for request in (
        RetrieveRequest(**prompt),
        ScoreRequest(**prompt, candidates=[{"text": "x"}]),
        RankRequest(**history, cache_scope="tenant-a", shared_prefix=16),
    ):
        assert Scope.of(request) == Scope("tenant-a", 16)
    assert Scope.of(RankRequest(**history)) == Scope(None, 0)  # by default: private, nothing shared


# -- both families on an engine: reuse read from the cache's counters ----------------------------------------------


def served(scheduler, engine, request):
    """(the result, the prompt tokens or history events it read from the prefix cache)."""
    before = scheduler.cache.stats.tokens_reused
    future = scheduler.submit(engine.prepare(request))
    while not scheduler.idle:
        scheduler.step()
    return future.result(), scheduler.cache.stats.tokens_reused - before


def prompts(engine, rng, n, length=70):
    return [random_prompt(engine, length, rng) for _ in range(n)]


def retrieve(prompt, **scope):
    return RetrieveRequest(prompt_token_ids=prompt, beam_width=4, **scope)


def test_another_users_guesses_reuse_nothing_so_a_timing_test_is_at_chance(engine, rng):
    """Victims' prompts are served; another user then tries guesses, half of them right (a victim's prompt, and its
    start with more after it), half wrong, once each: with their own scope, or none, no guess reads a block (so
    one-try accuracy is the wrong guesses' share, chance); in the victim's own scope the right ones do."""
    scheduler = Scheduler(engine.family, engine.runner)  # the prefix cache on
    victims = prompts(engine, rng, 4)
    for user, prompt in enumerate(victims):
        assert served(scheduler, engine, retrieve(prompt, cache_scope=f"user:{user}"))[1] == 0
    for attacker in ({"cache_scope": "user:mallory"}, {}):
        right = victims[:2] + [p[:40] + random_prompt(engine, 30, rng) for p in victims[2:]]
        guesses = [(p, True) for p in right] + [(p, False) for p in prompts(engine, rng, 4)]
        random.Random(0).shuffle(guesses)
        reused = [served(scheduler, engine, retrieve(p, **attacker))[1] for p, _ in guesses]
        assert reused == [0] * len(guesses), (attacker, reused)
        said_served = [r > 0 for r in reused]  # the attacker's best one-try rule (the counters beat any clock)
        accuracy = np.mean([said == truth for said, (_, truth) in zip(said_served, guesses, strict=True)])
        assert accuracy == 0.5  # chance: half the guesses were right
    for user, prompt in enumerate(victims):  # a returning user's own reuse is unchanged
        longer = prompt + random_prompt(engine, 9, rng)
        assert served(scheduler, engine, retrieve(longer, cache_scope=f"user:{user}"))[1] == 64


def test_the_victims_scope_still_reuses_which_is_why_user_ids_must_be_authenticated(engine, rng):
    """genrec does not authenticate user_id: a caller in the victim's scope (over HTTP, one who sends the victim's
    user_id) reads the victim's blocks. The docs say so; this pins it."""
    scheduler = Scheduler(engine.family, engine.runner)
    (victim,) = prompts(engine, rng, 1)
    served(scheduler, engine, retrieve(victim, cache_scope="user:victim"))
    assert served(scheduler, engine, retrieve(victim, cache_scope="user:victim"))[1] == 64


def test_a_declared_shared_prefix_is_reused_across_scopes_and_the_rest_is_not(engine, rng):
    scheduler = Scheduler(engine.family, engine.runner)
    template = random_prompt(engine, 2 * BLOCK, rng)  # every prompt opens with it
    first, second, third = (template + p for p in prompts(engine, rng, 3, length=50))
    shared = {"shared_prefix": 2 * BLOCK + 7}  # two whole blocks public; the partial third one is not
    assert served(scheduler, engine, retrieve(first, cache_scope="user:a", **shared))[1] == 0
    result, reused = served(scheduler, engine, retrieve(first, cache_scope="user:b", **shared))  # b: a's prompt
    assert reused == 2 * BLOCK
    (cold,) = engine.retrieve([retrieve(first)])  # the session engine: no cache
    assert [i.item_id for i in result.items] == [i.item_id for i in cold.items]
    assert np.allclose([i.logprob for i in result.items], [i.logprob for i in cold.items], atol=1e-4)
    assert served(scheduler, engine, retrieve(second, **shared))[1] == 2 * BLOCK  # keyless: its shared part only
    assert served(scheduler, engine, retrieve(third))[1] == 0  # keyless, nothing declared: nothing
    assert served(scheduler, engine, retrieve(first, cache_scope="user:a", **shared))[1] == 80  # a's own: all of it


def test_a_keyless_request_leaves_nothing_in_the_cache_but_its_shared_prefix(engine, rng):
    scheduler = Scheduler(engine.family, engine.runner)
    a, b = prompts(engine, rng, 2)
    served(scheduler, engine, retrieve(a))
    assert scheduler.cache.snapshot()["entries"] == 0 and scheduler.budget.pool.used == 0  # as with the cache off
    served(scheduler, engine, retrieve(b, shared_prefix=BLOCK))
    assert scheduler.cache.snapshot()["entries"] == 1
    assert served(scheduler, engine, retrieve(b))[1] == 0  # declared shared by nobody: not even b's first block


def events(rng: random.Random, n: int, start: float = 1e9) -> list[Event]:
    return [
        Event(
            item_id=f"item-{rng.randrange(HSTU_TINY.items):06d}", action=rng.choice([None, 0, 1]), timestamp=start + t
        )
        for t in range(n)
    ]


def test_the_rankers_history_cache_is_scoped_the_same_way(ranker, hstu_dir):
    from genrec.engine import Engine

    rng = random.Random(3)
    warm = Engine.from_pretrained(hstu_dir)  # the prefix cache on
    scheduler = warm.scheduler
    rank = lambda history, **scope: RankRequest(history=history, candidates=["item-000003"], **scope)  # noqa: E731
    victims = [events(rng, 60), events(rng, 60)]
    for user, history in enumerate(victims):
        assert served(scheduler, warm, rank(history, cache_scope=f"user:{user}"))[1] == 0
    for attacker in ({"cache_scope": "user:mallory"}, {}):
        right = [victims[0], victims[1][:40] + events(rng, 20, 2e9)]  # a victim's history; another's start
        guesses = right + [events(rng, 60), events(rng, 60)]
        assert [served(scheduler, warm, rank(g, **attacker))[1] for g in guesses] == [0] * 4, attacker
    returning = rank(victims[0] + events(rng, 5, 3e9), cache_scope="user:0")
    result, reused = served(scheduler, warm, returning)
    assert reused == 48  # the returning user: three whole blocks of 16 events
    (cold,) = ranker.rank([returning])  # the session's ranker: no cache
    assert np.allclose([i.scores["click"] for i in result.items], [i.scores["click"] for i in cold.items], atol=1e-5)
    template = events(rng, BLOCK)  # a public opening, declared shared
    served(scheduler, warm, rank(template + events(rng, 20, 4e9), cache_scope="user:a", shared_prefix=BLOCK))
    assert served(scheduler, warm, rank(template + events(rng, 20, 5e9), shared_prefix=BLOCK))[1] == BLOCK


# -- over HTTP: the ingress's scope of a body ---------------------------------------------------------------------


@pytest.mark.parametrize("body_type", [RetrieveBody, ScoreBody, RecommendBody])
def test_a_body_is_in_its_declared_scope_else_its_users_else_private(body_type):
    extra = {"candidates": [{"text": "x"}]} if body_type is ScoreBody else {}
    body = lambda **f: body_type(prompt_token_ids=[5, 6], user_embedding=[0.1], **extra, **f)  # noqa: E731
    assert body(cache_scope="tenant-a", user_id="u").to_request(None).cache_scope == "tenant-a"
    users = {cache_scope(body(user_id=u)) for u in ("u", "v", 42, "42", "x" * 256)}
    assert len(users) == 5 and all(s.startswith("user:") and len(s) <= 256 for s in users)
    assert body(user_id="u").to_request(None).cache_scope == cache_scope(body(user_id="u"))
    assert body().to_request(None).cache_scope is None
    assert body(shared_prefix=16).to_request(None).shared_prefix == 16


def test_a_rank_body_is_scoped_by_its_user_too():
    history = [{"item_id": "item-000001"}]
    body = RankBody(history=history, candidates=["item-000002"], user_id=7)
    assert (
        body.to_request().cache_scope
        == cache_scope(body)
        != cache_scope(RankBody(**body.model_dump() | {"user_id": 8}))
    )
    assert RankBody(history=history, candidates=["item-000002"]).to_request().cache_scope is None


def test_scope_fields_are_checked_like_other_fields():
    from pydantic import ValidationError

    for bad in ({"cache_scope": ""}, {"cache_scope": "x" * 257}, {"cache_scope": 3}, {"shared_prefix": -1},
                {"shared_prefix": True}, {"shared_prefix": 1.0}):  # fmt: skip
        with pytest.raises(ValidationError, match=next(iter(bad))):
            RetrieveBody(prompt_token_ids=[5], **bad)
    assert RetrieveRequest(prompt_token_ids=[5], shared_prefix=np.int64(3)).shared_prefix == 3
