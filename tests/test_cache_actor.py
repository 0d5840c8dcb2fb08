"""The shared cache as Ray actors: shared by name, sharded, durable across an actor crash, and refusing
at `connect` what it cannot serve."""

import asyncio
import time

import numpy as np
import pytest
from pydantic import ValidationError

from genrec.cache.actor import EmbeddingCache
from genrec.cache.config import CacheConfig
from genrec.errors import CacheError, StoreError

DIM = 16


def data(n, seed=0):
    return np.random.default_rng(seed).normal(size=(n, DIM)).astype(np.float32)


@pytest.fixture
def connect(ray_cluster):
    """EmbeddingCache.connect, with the test's actors killed afterwards (each is a worker process)."""
    made = []

    def _connect(config):
        made.append(EmbeddingCache.connect(config))
        return made[-1]

    yield _connect
    for cache in made:
        for actor in cache.actors:
            ray_cluster.kill(actor)


@pytest.mark.parametrize("shards", [1, 3])
def test_actor_round_trip_and_sharing_by_name(connect, tmp_path, shards):
    config = CacheConfig(
        name=f"rt-{shards}", dim=DIM, shards=shards, capacity=1000, store_path=str(tmp_path / "emb.sqlite")
    )
    cache = connect(config)
    assert cache.put(np.arange(300), data(300)) == 300
    same = connect(config)  # another process would do this
    got, found = same.get(np.arange(-5, 300))
    assert found.tolist() == [False] * 5 + [True] * 300
    assert got[5:].tobytes() == data(300).tobytes()
    if shards > 1:
        assert all(s["resident"] > 0 for s in cache.stats())


def test_acknowledged_puts_survive_an_actor_crash(connect, tmp_path):
    import ray

    config = CacheConfig(name="crash", dim=DIM, capacity=100, store_path=str(tmp_path / "crash.sqlite"))
    cache = connect(config)
    keys = np.arange(1000, 1500)
    cache.put(keys, data(500))  # acknowledged: put returned
    before = ray.get(cache.actors[0].incarnation.remote())
    ray.kill(cache.actors[0], no_restart=False)
    deadline = time.monotonic() + 60
    while True:  # the kill is asynchronous: wait until a new incarnation answers
        try:
            if ray.get(cache.actors[0].incarnation.remote(), timeout=5) != before:
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, "the cache actor did not come back"
        time.sleep(0.2)
    assert cache.stats()[0]["resident"] == 0  # a fresh actor: the table starts empty
    got, found = cache.get(keys)
    assert found.all() and got.tobytes() == data(500).tobytes()


def _name_is_free(name: str, namespace: str = "genrec", wait_s: float = 60.0) -> bool:
    import ray

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return True
        time.sleep(0.1)
    return False


def test_connect_refuses_a_name_held_with_another_configuration(connect):
    """Issue 13 item 15: connecting with another dim silently returned a client of the old width."""
    config = CacheConfig(name="conflict", dim=DIM, capacity=100, store="none")
    cache = connect(config)
    cache.put([1], data(1))
    with pytest.raises(CacheError, match=f"shard 0 exists with dim={DIM} .asked 8."):
        connect(config.model_copy(update={"dim": 8}))
    with pytest.raises(CacheError, match="policy='lru' .asked 'lfu'."):
        connect(config.model_copy(update={"policy": "lfu"}))
    with pytest.raises(CacheError, match="shards=1 .asked 2."):
        connect(config.model_copy(update={"shards": 2}))
    assert _name_is_free("conflict-1")  # the shard that connect created for shards=2 is gone again
    got, found = connect(config).get([1])
    assert found.all() and np.array_equal(got, data(1))


def test_a_store_that_cannot_open_fails_connect(connect, tmp_path):
    """Issue 13 item 22: an unreachable Redis surfaced only at the first get, an unknown store as ActorDiedError."""
    unreachable = CacheConfig(name="no-redis", dim=DIM, store="redis", redis_url="redis://127.0.0.1:1/0")
    with pytest.raises(StoreError, match="shard 0 cannot start: redis at redis://127.0.0.1:1/0"):
        connect(unreachable)
    assert _name_is_free("no-redis-0")  # free for the corrected configuration
    fixed = CacheConfig(name="no-redis", dim=DIM, store_path=str(tmp_path / "fixed.sqlite"))
    cache = connect(fixed)
    assert cache.put([1], data(1)) == 1
    # A SQLite file written with another width is refused the same way.
    wider = CacheConfig(name="other-width", dim=2 * DIM, store_path=str(tmp_path / "fixed.sqlite"))
    with pytest.raises(StoreError, match=f"holds {DIM}-d vectors"):
        connect(wider)


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"store": "postgres"}, "store"),
        ({"dim": 0}, "dim"),
        ({"shards": 0}, "shards"),
        ({"capacity": 0}, "capacity"),
        ({"policy": "fifo"}, "unknown eviction policy 'fifo'"),
        ({"admit_after": 0}, "admit_after"),
        ({"store": "redis", "redis_url": "127.0.0.1:6379"}, "redis_url"),
        ({"store_path": ""}, "store_path"),
        ({"name": ""}, "name"),
        ({"dimension": 4}, "dimension"),
    ],
)
def test_a_bad_configuration_fails_before_any_actor(fields, problem):
    with pytest.raises(ValidationError, match=problem):
        CacheConfig(**{"name": "bad", "dim": DIM, **fields})


def test_connect_needs_a_dim_and_with_dim_refuses_another(ray_cluster):
    config = CacheConfig(name="no-dim", store="none")
    with pytest.raises(CacheError, match="dim is not set"):
        EmbeddingCache.connect(config)
    assert config.with_dim(DIM).dim == DIM == config.with_dim(DIM).with_dim(DIM).dim
    with pytest.raises(CacheError, match=f"dim is {DIM} but the vectors here are 8-d"):
        config.with_dim(DIM).with_dim(8)


def test_a_put_of_the_wrong_shape_is_refused_before_any_shard_is_written(connect):
    """Issue 13 item 20: a sharded put of more vectors than keys returned success, fewer raised IndexError."""
    cache = connect(CacheConfig(name="shapes", dim=DIM, shards=3, capacity=100, store="none"))
    nan = data(3)
    nan[2, 0] = np.nan
    for vectors, problem in ((data(5), "shape"), (data(2), "shape"), (data(3)[:, 1:], "shape"), (nan, "non-finite")):
        with pytest.raises(CacheError, match=problem):
            cache.put(np.arange(3), vectors)
    assert not cache.get(np.arange(3))[1].any()
    with pytest.raises(CacheError, match="None"):
        cache.get(["a", None])


@pytest.mark.parametrize("shards", [1, 3])
def test_get_async_awaits_the_shards_without_blocking_the_loop(connect, tmp_path, shards):
    config = CacheConfig(
        name=f"async-{shards}", dim=DIM, shards=shards, capacity=1000, store_path=str(tmp_path / "async.sqlite")
    )
    cache = connect(config)
    cache.put(np.arange(300), data(300))
    ids = np.arange(-5, 300)

    async def main():
        events = []

        async def ticker():  # runs only while the lookup awaits
            while "got" not in events:
                events.append("tick")
                await asyncio.sleep(0)

        async def lookup():
            result = await cache.get_async(ids)
            events.append("got")
            return result

        result, _ = await asyncio.gather(lookup(), ticker())
        return result, events

    (got, found), events = asyncio.run(main())
    assert events[0] == "tick"  # a blocking ray.get would have finished the lookup first
    expected, expected_found = cache.get(ids)
    assert found.tolist() == expected_found.tolist() == [False] * 5 + [True] * 300
    assert got.tobytes() == expected.tobytes() and got[5:].tobytes() == data(300).tobytes()
