"""The shared embedding cache as Ray actors, one per shard (docs/serving.md, "User vectors: the embedding cache").
`EmbeddingCache.connect` creates or finds the named actors and waits until each answers with its configuration;
batches fan out by key hash. Actors restart after a crash and refill by reading through the durable store.
Vectors travel as numpy arrays: a batch of 1,000 x 128 floats (512 KiB) is above Ray's default inline limit
(100 KiB), so each reply would go through the object store, which costs more than the lookup itself. Start the
cluster with `max_direct_call_object_size` of a few MiB (cluster.yaml does); `genrec bench cache` measures both.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from genrec.cache.config import CacheConfig
from genrec.cache.keys import checked_batch, mix64, normalize_keys
from genrec.cache.metrics import CacheMetrics
from genrec.cache.table import EmbeddingTable
from genrec.errors import CacheError, GenrecError, StoreError


def open_store(config: CacheConfig, shard: int):
    from genrec.cache.stores import RedisStore, SQLiteStore

    if config.store == "sqlite":
        path = f"{config.store_path}.{shard}" if shard else config.store_path
        return SQLiteStore(path, config.dim, owner=f"cache {config.name!r} shard {shard} of {config.shards}")
    if config.store == "redis":  # every shard reads and writes the one keyspace
        return RedisStore(config.redis_url, config.dim, owner=config.name)
    return None


@ray.remote(max_restarts=-1, max_task_retries=-1)
class EmbeddingCacheActor:
    """One shard. A store that does not open leaves the actor up without a table: each call retries the open and
    raises its StoreError, which reaches the caller as itself (from __init__ it would be a bare ActorDiedError)."""

    def __init__(self, config: CacheConfig, shard: int):
        self.started = uuid.uuid4().hex  # tells a restarted actor from the one before it
        self.config, self.shard = config, shard
        self.table: EmbeddingTable | None = None
        with contextlib.suppress(GenrecError):
            self._table()
        CacheMetrics(config.name, shard).export_every(self._table_stats)

    def _table(self) -> EmbeddingTable:
        if self.table is None:
            c = self.config
            self.table = EmbeddingTable(c.dim, c.capacity, c.policy, c.admit_after, store=open_store(c, self.shard))
        return self.table

    def _table_stats(self):
        """The lookups counted so far (None: no table, its store has not opened). Never opens one: it is read from
        the metrics thread."""
        return None if self.table is None else self.table.stats

    def describe(self) -> dict:
        """The configuration this shard serves (raises if its store does not open)."""
        self._table()
        return self.config.model_dump()

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._table().get(keys)

    def put(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        return self._table().put(keys, vectors)

    def stats(self) -> dict:
        table = self._table()
        return {**table.stats.as_dict(), "resident": len(table)}

    def incarnation(self) -> str:
        return self.started


class EmbeddingCache:
    """Client of one or more cache actors. Picklable: pass it to Serve replicas and Ray Data workers."""

    def __init__(self, actors: list, dim: int):
        self.actors, self.dim = actors, dim

    @classmethod
    def connect(
        cls, config: CacheConfig, namespace: str | None = "genrec", num_cpus=0, timeout_s: float = 60.0
    ) -> EmbeddingCache:
        """The client of `config.name`'s actors, created with `config` if they do not exist yet."""
        if config.dim is None:
            raise CacheError(f"cache {config.name!r}: dim is not set (CacheConfig.with_dim)")
        options = {"namespace": namespace, "get_if_exists": True, "lifetime": "detached", "num_cpus": num_cpus}
        actors = [
            EmbeddingCacheActor.options(name=f"{config.name}-{i}", **options).remote(config, i)
            for i in range(config.shards)
        ]
        _check_started(config.name, actors, config.model_dump(), timeout_s)
        return cls(actors, config.dim)

    def _shard_of(self, keys: np.ndarray) -> np.ndarray:
        return (mix64(keys) % np.uint64(len(self.actors))).astype(np.int64)

    def _fan_out(self, method: str, keys: np.ndarray, *columns: np.ndarray) -> list:
        """Send each shard its keys (and their rows of `columns`): [(positions in the batch or None, ref)]."""
        if len(self.actors) == 1:
            return [(None, getattr(self.actors[0], method).remote(keys, *columns))]
        shard = self._shard_of(keys)
        calls = []
        for s, actor in enumerate(self.actors):
            if len(positions := np.flatnonzero(shard == s)):
                rows = (c[positions] for c in columns)
                calls.append((positions, getattr(actor, method).remote(keys[positions], *rows)))
        return calls

    def _gather(self, n: int, calls: list, replies: list) -> tuple[np.ndarray, np.ndarray]:
        if len(calls) == 1 and calls[0][0] is None:
            return replies[0]
        out = np.zeros((n, self.dim), dtype=np.float32)
        found = np.zeros(n, dtype=bool)
        for (positions, _), (vectors, hit) in zip(calls, replies, strict=True):
            out[positions] = vectors
            found[positions] = hit
        return out, found

    def get(self, ids) -> tuple[np.ndarray, np.ndarray]:
        keys = normalize_keys(ids)
        calls = self._fan_out("get", keys)
        return self._gather(len(keys), calls, ray.get([ref for _, ref in calls]))

    async def get_async(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """`get` for an event loop (a Serve ingress): awaits the shards' replies, never blocks the loop."""
        keys = normalize_keys(ids)
        calls = self._fan_out("get", keys)
        return self._gather(len(keys), calls, await asyncio.gather(*(ref for _, ref in calls)))

    def put(self, ids, vectors) -> int:
        """Write `vectors` [n, dim] under `ids` [n] (checked here, before any shard is written)."""
        keys, matrix = checked_batch(ids, vectors, self.dim)
        return sum(ray.get([ref for _, ref in self._fan_out("put", keys, matrix)]))

    def stats(self) -> list[dict]:
        return ray.get([a.stats.remote() for a in self.actors])


def _check_started(name: str, actors: list, wanted: dict, timeout_s: float) -> None:
    """Wait for every shard's configuration; raise if one cannot start or serves another configuration."""
    refs = [a.describe.remote() for a in actors]
    deadline = time.monotonic() + timeout_s
    conflicts, failures, ours = [], [], []
    for i, (actor, ref) in enumerate(zip(actors, refs, strict=True)):
        try:
            have = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
        except GetTimeoutError:
            failures.append(f"shard {i} did not answer within {timeout_s} s")
        except RayTaskError as e:  # e.g. its store does not open: free the name for a corrected configuration
            ray.kill(actor)
            failures.append(f"shard {i} cannot start: {getattr(e, 'cause', None) or e}")
        except RayActorError as e:
            failures.append(f"shard {i} did not start: {e}")
        else:
            if have == wanted:
                ours.append(actor)
            else:
                differ = ", ".join(f"{k}={have.get(k)!r} (asked {v!r})" for k, v in wanted.items() if have.get(k) != v)
                conflicts.append(f"shard {i} exists with {differ}")
    if conflicts:  # the shards just created for this configuration would only hold memory
        for actor in ours:
            ray.kill(actor)
        raise CacheError(f"embedding cache {name!r}: " + "; ".join(conflicts))
    if failures:
        raise StoreError(f"embedding cache {name!r}: " + "; ".join(failures))
