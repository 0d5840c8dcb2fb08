"""The shared embedding cache as Ray actors: every Serve replica and Ray Data worker uses the same one.

`EmbeddingCache.connect(...)` creates or finds the named actor(s) (`get_if_exists=True`). With `shards=K`
it creates K actors and fans each batch out by key hash, then gathers. Actors restart after a crash
(`max_restarts=-1`); the table refills by reading through the durable store, so nothing acknowledged is lost.
Vectors travel as numpy arrays. A batch of 1,000 x 128 floats is 512 KiB: above Ray's default inline
limit (100 KiB) each reply goes through the object store, which costs more than the lookup itself. Start
the cluster with `max_direct_call_object_size` of a few MiB (cluster.yaml sets
RAY_max_direct_call_object_size) so replies travel inline; `genrec bench cache` measures both.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass

import numpy as np
import ray

from genrec.cache.keys import normalize_keys
from genrec.cache.table import EmbeddingTable


@dataclass(frozen=True)
class CacheConfig:
    dim: int
    capacity: int = 1_000_000
    policy: str = "lru"
    admit_after: int = 1
    store: str = "sqlite"  # sqlite | redis | none
    store_path: str = "/tmp/genrec-embeddings.sqlite"  # sqlite: the file (one per shard, suffixed)
    redis_url: str = "redis://127.0.0.1:6379/0"


def open_store(config: CacheConfig, shard: int):
    from genrec.cache.stores import RedisStore, SQLiteStore

    if config.store == "sqlite":
        return SQLiteStore(f"{config.store_path}.{shard}" if shard else config.store_path, config.dim)
    if config.store == "redis":
        return RedisStore(config.redis_url, config.dim)
    if config.store == "none":
        return None
    raise ValueError(f"unknown store {config.store!r}")


@ray.remote(max_restarts=-1, max_task_retries=-1)
class EmbeddingCacheActor:
    def __init__(self, config: dict, shard: int):
        self.started = uuid.uuid4().hex  # tells a restarted actor from the one before it
        config = CacheConfig(**config)
        self.table = EmbeddingTable(
            config.dim, config.capacity, config.policy, config.admit_after, store=open_store(config, shard)
        )

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.table.get(keys)

    def put(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        return self.table.put(keys, vectors)

    def stats(self) -> dict:
        return {**self.table.stats.as_dict(), "resident": len(self.table)}

    def incarnation(self) -> str:
        return self.started


class EmbeddingCache:
    """Client of one or more cache actors. Picklable: pass it to Serve replicas and Ray Data workers."""

    def __init__(self, actors: list, dim: int):
        self.actors, self.dim = actors, dim

    @classmethod
    def connect(
        cls, name: str, config: CacheConfig, shards: int = 1, namespace: str | None = "genrec", num_cpus=0
    ) -> EmbeddingCache:
        actors = [
            EmbeddingCacheActor.options(
                name=f"{name}-{i}", namespace=namespace, get_if_exists=True, lifetime="detached", num_cpus=num_cpus
            ).remote(asdict(config), i)
            for i in range(shards)
        ]
        return cls(actors, config.dim)

    def _shard_of(self, keys: np.ndarray) -> np.ndarray:
        from genrec.cache.hash_index import mix64

        return (mix64(keys) % np.uint64(len(self.actors))).astype(np.int64)

    def get(self, ids) -> tuple[np.ndarray, np.ndarray]:
        keys = normalize_keys(ids)
        if len(self.actors) == 1:
            return ray.get(self.actors[0].get.remote(keys))
        shard = self._shard_of(keys)
        parts = {s: np.flatnonzero(shard == s) for s in range(len(self.actors))}
        refs = {s: self.actors[s].get.remote(keys[idx]) for s, idx in parts.items() if len(idx)}
        out = np.zeros((len(keys), self.dim), dtype=np.float32)
        found = np.zeros(len(keys), dtype=bool)
        for s, (vectors, hit) in zip(refs, ray.get(list(refs.values())), strict=True):
            out[parts[s]] = vectors
            found[parts[s]] = hit
        return out, found

    def put(self, ids, vectors) -> int:
        keys = normalize_keys(ids)
        matrix = np.asarray(vectors, dtype=np.float32)
        if len(self.actors) == 1:
            return ray.get(self.actors[0].put.remote(keys, matrix))
        shard = self._shard_of(keys)
        refs = [
            self.actors[s].put.remote(keys[idx], matrix[idx])
            for s in range(len(self.actors))
            if len(idx := np.flatnonzero(shard == s))
        ]
        return sum(ray.get(refs))

    def stats(self) -> list[dict]:
        return ray.get([a.stats.remote() for a in self.actors])
