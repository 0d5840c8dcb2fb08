"""The shared cache as Ray actors: shared by name, sharded, and durable across an actor crash."""

import time

import numpy as np
import pytest

from genrec.cache.actor import CacheConfig, EmbeddingCache

DIM = 16


def data(n, seed=0):
    return np.random.default_rng(seed).normal(size=(n, DIM)).astype(np.float32)


@pytest.mark.parametrize("shards", [1, 3])
def test_actor_round_trip_and_sharing_by_name(ray_cluster, tmp_path, shards):
    config = CacheConfig(dim=DIM, capacity=1000, store_path=str(tmp_path / "emb.sqlite"))
    cache = EmbeddingCache.connect(f"rt-{shards}", config, shards=shards)
    assert cache.put(np.arange(300), data(300)) == 300
    same = EmbeddingCache.connect(f"rt-{shards}", config, shards=shards)  # another process would do this
    got, found = same.get(np.arange(-5, 300))
    assert found.tolist() == [False] * 5 + [True] * 300
    assert got[5:].tobytes() == data(300).tobytes()
    if shards > 1:
        assert all(s["resident"] > 0 for s in cache.stats())


def test_acknowledged_puts_survive_an_actor_crash(ray_cluster, tmp_path):
    import ray

    config = CacheConfig(dim=DIM, capacity=100, store_path=str(tmp_path / "crash.sqlite"))
    cache = EmbeddingCache.connect("crash", config)
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
