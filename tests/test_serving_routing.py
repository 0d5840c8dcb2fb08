"""Routing each user to one engine replica: rendezvous hashing (pure: scaling moves about 1/N of the keys, the
candidates' order never matters), the router's ranks and backoff, the ingress's routing keys, and on a real
Serve app with two engine replicas, a user's requests all reaching the replica their key names."""

import asyncio
import random
import string
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from ray.serve._private.request_router.common import RequestRoutingContext

from genrec.api import Event, RankRequest
from genrec.serving.router import FIRST_BLOCK, ROUTING_KEY, UserRouter, ranks, rendezvous_order, routing_key, widening
from genrec.serving.schemas import RankBody, RetrieveBody
from tests.conftest import TINY
from tests.serve_apps import delete, deploy_many, sticky

KEYS = [f"user:{i!r}" for i in range(1000)]


def replica_ids(n: int, seed: int = 0) -> list[str]:
    """Like Serve's: 8 random lowercase letters and digits."""
    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_lowercase + string.digits, k=8)) for _ in range(n)]


def primaries(replicas: list[str]) -> dict[str, str]:
    return {key: rendezvous_order(key, replicas)[0] for key in KEYS}


# -- rendezvous hashing -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_one_more_replica_moves_about_1_over_n_keys_all_to_it(n):
    before_ids = replica_ids(n + 1, seed=n)
    before, after = primaries(before_ids[:n]), primaries(before_ids)
    moved = [k for k in KEYS if before[k] != after[k]]
    assert 0.5 / (n + 1) <= len(moved) / len(KEYS) <= 1.5 / n
    assert {after[k] for k in moved} == {before_ids[n]}  # only to the new replica, never between old ones


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_one_replica_fewer_moves_only_its_keys(n):
    ids = replica_ids(n, seed=100 + n)
    before, after = primaries(ids), primaries(ids[1:])
    moved = [k for k in KEYS if before[k] != after[k]]
    assert 0.5 / n <= len(moved) / len(KEYS) <= 1.5 / n
    assert all(before[k] == ids[0] for k in moved)  # only the keys of the replica that went


def test_the_candidates_order_never_changes_a_keys_order():
    ids = replica_ids(6, seed=7)
    rng = random.Random(1)
    for key in KEYS[:200]:
        want = rendezvous_order(key, ids)
        shuffled = ids[:]
        rng.shuffle(shuffled)
        assert rendezvous_order(key, shuffled) == want


def test_keys_spread_over_the_replicas():
    ids = replica_ids(4, seed=3)
    counts = {rid: 0 for rid in ids}
    for primary in primaries(ids).values():
        counts[primary] += 1
    assert all(150 <= c <= 350 for c in counts.values()), counts


def test_ranks_are_primary_fallback_rest_and_widen_with_the_wait():
    ids = replica_ids(5)
    order = rendezvous_order("user:'a'", ids)
    assert ranks("user:'a'", ids) == [order[:1], order[1:2], order[2:]]
    assert ranks("user:'a'", ids, widen=0) == [order[:1]]
    assert ranks("user:'a'", ids, widen=1) == [order[:1], order[1:2]]
    assert ranks("user:'a'", ids[:1]) == [ids[:1]]
    assert [len(r) for r in ranks("user:'a'", ids[:2])] == [1, 1]
    assert [widening(t, 0.1) for t in (0.0, 0.09, 0.1, 0.19, 0.2, 5.0)] == [0, 0, 1, 1, 2, 2]
    assert widening(0.0, 0.0) == 2


def fake_replica(unique_id: str, catalog_served: bool | None = None):
    stats = {} if catalog_served is None else {"catalog_served": catalog_served}  # {}: no stats received yet
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=unique_id), routing_stats=stats)


def pending(key, waited_s: float = 0.0):
    kwargs = {} if key is None else {ROUTING_KEY: key}
    return SimpleNamespace(kwargs=kwargs, created_at=time.time() - waited_s, routing_context=RequestRoutingContext())


def router(**kwargs) -> UserRouter:
    """The routing policy alone (Serve's constructor wires metrics and replica tracking, not needed here)."""
    chosen = UserRouter.__new__(UserRouter)
    chosen.initialize_state(**kwargs)
    return chosen


def choose(chosen_router: UserRouter, replicas, request):
    return asyncio.run(chosen_router.choose_replicas(replicas, request))


def test_the_router_offers_the_primary_first_with_backoff():
    replicas = [fake_replica(rid) for rid in replica_ids(4)]
    order = rendezvous_order("user:7", [r.replica_id.unique_id for r in replicas])
    fresh = pending("user:7")
    chosen = choose(router(), list(reversed(replicas)), fresh)
    assert [[r.replica_id.unique_id for r in rank] for rank in chosen] == [order[:1]]
    assert fresh.routing_context.should_backoff  # a busy primary is retried after a sleep, not spun on
    late = choose(router(spill_after_s=0.05), replicas, pending("user:7", waited_s=0.2))
    assert [[r.replica_id.unique_id for r in rank] for rank in late] == [order[:1], order[1:2], order[2:]]


def test_a_request_without_a_key_goes_to_two_random_replicas():
    replicas = [fake_replica(rid) for rid in replica_ids(4)]
    request = pending(None)
    (rank,) = choose(router(), replicas, request)
    assert len(rank) == 2 and request.routing_context.should_backoff
    assert choose(router(), replicas[:1], None) == [replicas[:1]]


def test_a_replica_refusing_for_want_of_its_catalog_is_ranked_after_every_other():
    """Whoever the key's primary is, a replica whose routing stats say it serves no declared catalog is offered
    last, once the request may go anywhere; when none serves it, the ranks are as ever."""
    ids = replica_ids(4)
    for refused in ids:
        replicas = [fake_replica(rid, catalog_served=rid != refused) for rid in ids]
        order = [rid for rid in rendezvous_order("user:7", ids) if rid != refused]
        for waited_s, expected in ((0.0, [order[:1]]), (0.2, [order[:1], order[1:2], order[2:], [refused]])):
            chosen = choose(router(spill_after_s=0.05), replicas, pending("user:7", waited_s))
            assert [[r.replica_id.unique_id for r in rank] for rank in chosen] == expected
        (rank,) = choose(router(), replicas, pending(None))
        assert refused not in {r.replica_id.unique_id for r in rank}
    every = [fake_replica(rid, catalog_served=False) for rid in ids]
    chosen = choose(router(spill_after_s=0.05), every, pending("user:7", waited_s=0.2))
    full = rendezvous_order("user:7", ids)
    assert [[r.replica_id.unique_id for r in rank] for rank in chosen] == [full[:1], full[1:2], full[2:]]


def test_router_kwargs_are_checked():
    with pytest.raises(ValueError, match="spill_after_s"):
        router(spill_after_s=-1)
    with pytest.raises(TypeError):
        router(spill_after=0.1)  # a typo fails the router's start instead of vanishing


# -- routing keys ------------------------------------------------------------------------------------


def test_the_key_is_the_user_else_the_prompts_first_block():
    from genrec.engine.prefix_cache import BLOCK

    assert FIRST_BLOCK == BLOCK
    tokens = list(range(3, 40))
    assert routing_key(RetrieveBody(prompt_token_ids=tokens, user_id="42")) == "user:'42'"
    assert routing_key(RetrieveBody(prompt_token_ids=tokens, user_id=42)) == "user:42"
    by_block = routing_key(RetrieveBody(prompt_token_ids=tokens))
    assert routing_key(RetrieveBody(prompt_token_ids=tokens[:FIRST_BLOCK] + [99, 98])) == by_block
    assert routing_key(RetrieveBody(prompt_token_ids=[4] + tokens[1:])) != by_block
    text = "user listened to " + "comedy podcast episode " * 5
    assert routing_key(RetrieveBody(prompt=text + "a")) == routing_key(RetrieveBody(prompt=text + "b"))
    assert routing_key(RetrieveBody(prompt="x" + text)) != routing_key(RetrieveBody(prompt=text))


def test_more_prefix_blocks_tell_apart_prompts_that_open_with_one_template():
    template = list(range(3, 3 + FIRST_BLOCK))  # every prompt opens with it
    alice, bob = template + list(range(50, 70)), template + list(range(80, 100))
    one = [routing_key(RetrieveBody(prompt_token_ids=p)) for p in (alice, bob)]
    two = [routing_key(RetrieveBody(prompt_token_ids=p), blocks=2) for p in (alice, bob)]
    assert one[0] == one[1] and two[0] != two[1]
    returning = RetrieveBody(prompt_token_ids=alice + [7, 8, 9])  # alice again: her prompt plus new events
    assert routing_key(returning, blocks=2) == two[0]
    text = "you recommend movies. " * 3  # 66 characters: past one text block
    keys = {routing_key(RetrieveBody(prompt=text + who), blocks=b) for who in ("alice", "bob") for b in (1, 2)}
    assert len(keys) == 3  # one key for both at one block, one each at two
    events = [Event(item_id=f"item-{i:06d}") for i in range(40)]
    edited = events[:FIRST_BLOCK] + [Event(item_id="item-000099")] + events[FIRST_BLOCK + 1 :]
    ranked = [RankBody(history=h, candidates=["item-000001"]) for h in (events, edited)]
    assert routing_key(ranked[0]) == routing_key(ranked[1])
    assert routing_key(ranked[0], blocks=2) != routing_key(ranked[1], blocks=2)


def test_a_rank_requests_key_is_the_user_else_its_first_events():
    events = [Event(item_id=f"item-{i:06d}", action=i % 3, timestamp=1e9 + i) for i in range(30)]
    body = RankBody(history=events, candidates=["item-000001"])
    assert routing_key(RankBody(history=events, candidates=["item-000001"], user_id="u")) == "user:'u'"
    longer = RankBody(history=events[:FIRST_BLOCK] + [Event(item_id="item-000099")], candidates=["item-000002"])
    assert routing_key(longer) == routing_key(body)
    edited = RankBody(history=[Event(item_id="item-000099"), *events[1:]], candidates=["item-000001"])
    assert routing_key(edited) != routing_key(body)
    assert isinstance(body.to_request(), RankRequest) and "user_id" not in body.to_request().model_dump()


# -- on a real Serve app: two engine replicas, the user router against Serve's default -----------------


def two_replicas(tiny_dir, router: str, routing_prefix_blocks: int = 1) -> dict:
    engine = {"model_dir": str(tiny_dir), "kv_budget_bytes": 64 << 20, "deployment": {"num_replicas": 2}}
    ingress = {"limits": {"request_timeout_s": 20}, "routing_prefix_blocks": routing_prefix_blocks}
    return {"retriever": engine | {"router": router}, "ingress": ingress}


@pytest.fixture(scope="module")
def two_replica_urls(serve_url, tiny_dir):
    routed = two_replicas(tiny_dir, "user", routing_prefix_blocks=2)  # keyless prompts: past a one-block template
    spread = two_replicas(tiny_dir, "serve_default")
    deploy_many({"routed": (sticky("EngineServer"), routed), "spread": (None, spread)})
    yield {app: f"{serve_url}/{app}" for app in ("routed", "spread")}
    delete("routed")
    delete("spread")


def replica_requests(app: str) -> dict[str, int]:
    """Retrieve requests each engine replica has served, asked of every replica through a handle."""
    from ray import serve

    handle = serve.get_deployment_handle("EngineServer", app_name=app)
    served = {}
    for i in range(200):  # a random key (user router) or a random pick (Serve's) reaches each in a few tries
        stats = handle.stats.remote(**{ROUTING_KEY: f"probe-{random.random()}-{i}"}).result(timeout_s=30)
        served[stats["replica"]] = stats["metrics"]["requests"].get("retrieve:ok", 0)
        if len(served) == 2:
            return served
    raise AssertionError(f"reached only {sorted(served)} of 2 replicas of {app}")


def replicas_per_user(url: str, app: str, client, users: list[str], visits: int) -> dict[str, set[str]]:
    """Which replicas served each user's requests (one user at a time, so the counts tell)."""
    vector = np.random.default_rng(0).normal(size=TINY.user_dim).round(4).tolist()
    hit = {}
    for user in users:
        before = replica_requests(app)
        for visit in range(visits):  # a returning user: the previous prompt plus a few events
            prompt = f"{user} listened to comedy podcast episode " + "then news daily " * visit + "<|user|>"
            body = {"prompt": prompt, "user_embedding": vector, "beam_width": 4, "user_id": user}
            response = client.post(f"{url}/v1/retrieve", json=body)
            assert response.status_code == 200, response.text
        after = replica_requests(app)
        hit[user] = {rid for rid in after if after[rid] > before.get(rid, 0)}
    return hit


def test_the_user_router_sends_a_users_requests_to_its_primary_and_the_default_spreads_them(two_replica_urls):
    users = ["alice", "bob", "carol"]
    with httpx.Client(timeout=60) as client:
        routed = replicas_per_user(two_replica_urls["routed"], "routed", client, users, visits=6)
        spread = replicas_per_user(two_replica_urls["spread"], "spread", client, users, visits=6)
    ids = list(replica_requests("routed"))
    for user in users:
        assert routed[user] == {rendezvous_order(f"user:{user!r}", ids)[0]}  # the key's primary, every time
    # Serve's default picks between the two at random: 18 requests of 3 users all stuck is a 3e-5 chance.
    assert any(len(replicas) == 2 for replicas in spread.values()), spread


def test_keyless_prompts_after_one_template_route_by_their_first_two_blocks(two_replica_urls):
    """The app's routing_prefix_blocks reaches the ingress: keyless prompts that open with one 16-token template
    each go to the primary of their two-block key (not all to the template's), so both replicas get some."""
    template = list(range(3, 3 + FIRST_BLOCK))
    ids = list(replica_requests("routed"))
    expected, hit = {}, {}
    with httpx.Client(timeout=60) as client:
        for user in range(16):
            prompt = template + [40 + user] * FIRST_BLOCK
            key = routing_key(RetrieveBody(prompt_token_ids=prompt), blocks=2)
            expected[user] = rendezvous_order(key, ids)[0]
            before = replica_requests("routed")
            response = client.post(f"{two_replica_urls['routed']}/v1/retrieve", json={"prompt_token_ids": prompt})
            assert response.status_code == 200, response.text
            after = replica_requests("routed")
            hit[user] = {rid for rid in after if after[rid] > before.get(rid, 0)}
    assert all(hit[user] == {expected[user]} for user in hit), (hit, expected)
    assert len(set(expected.values())) == 2, expected  # 16 keys all on one of 2 replicas: 2 ** -15
