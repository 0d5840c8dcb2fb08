"""`genrec bench cache`: batched get throughput of the in-process table, the Ray actor path and Redis MGET
on the same keys and batches, and each eviction policy's hit rate at 10 % capacity under a Zipf workload.

Redis is a private redis-server on 127.0.0.1 and a free port (`LocalRedis`; the tests' real server too). It only
starts an installed redis-server; installing one is the caller's business (the tests' fixture does)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time

import numpy as np

from genrec.cache import EmbeddingTable, RedisStore
from genrec.cache.policies import POLICIES
from genrec.errors import GenrecError
from genrec_bench.cli import CacheOptions
from genrec_bench.common import machine

INLINE_RETURN_BYTES = 4 << 20


class ArrayStore:
    """Every key 0..n-1 present: a stand-in *source of truth* for the hit-rate simulation only."""

    def __init__(self, vectors: np.ndarray):
        self.vectors, self.dim = vectors, vectors.shape[1]

    def get_many(self, keys):
        return self.vectors[keys], np.ones(len(keys), dtype=bool)

    def put_many(self, keys, vectors):
        self.vectors[keys] = vectors


def zipf_batches(keys: int, batch: int, count: int, a: float, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    weights = np.arange(1, keys + 1, dtype=np.float64) ** -a
    cdf = np.cumsum(weights / weights.sum())
    permutation = rng.permutation(keys)  # popular keys are not the small integers
    return [permutation[np.minimum(np.searchsorted(cdf, rng.random(batch)), keys - 1)] for _ in range(count)]


def _fill(put, keys, vectors, chunk: int) -> None:
    for start in range(0, len(keys), chunk):
        put(keys[start : start + chunk], vectors[start : start + chunk])


def _throughput(get, batches) -> float:
    get(batches[0])
    start = time.perf_counter()
    for b in batches:
        get(b)
    return sum(len(b) for b in batches) / (time.perf_counter() - start)


def run(o: CacheOptions, hit_rate_batches: int = 3000) -> dict:
    if not o.redis_url:
        redis_server()  # refused before anything is measured
    keys, dim, batch, zipf, batches = o.keys, o.dim, o.batch, o.zipf, o.batches
    vectors = np.random.default_rng(1).normal(size=(keys, dim)).astype(np.float32)
    all_keys = np.arange(keys, dtype=np.int64)
    workload = zipf_batches(keys, batch, batches, zipf)

    table = EmbeddingTable(dim, capacity=keys)
    _fill(table.put, all_keys, vectors, 100_000)
    in_process = _throughput(table.get, workload)
    del table

    import ray

    if ray.is_initialized():  # inside a running cluster: its settings, whatever they are
        actor = actor_default = _actor_throughput(vectors, all_keys, workload, inline_bytes=None)
    else:
        actor_default = _actor_throughput(vectors, all_keys, workload, inline_bytes=None)
        actor = _actor_throughput(vectors, all_keys, workload, inline_bytes=INLINE_RETURN_BYTES)
    with contextlib.nullcontext(o.redis_url) if o.redis_url else LocalRedis() as url:
        store = RedisStore(url, dim, prefix=f"bench:{dim}:")  # a store records its width: one prefix a dim
        _fill(store.put_many, all_keys, vectors, 20_000)
        redis_mget = _throughput(store.get_many, workload)
        store.close()

    # Long enough that a 10 % table fills and evicts many times over.
    long_workload = zipf_batches(keys, batch, hit_rate_batches, zipf, seed=2)
    hit_rates = {name: _hit_rate(name, vectors, keys // 10, long_workload) for name in POLICIES}
    return {
        "benchmark": "cache",
        "keys": keys,
        "dim": dim,
        "batch": batch,
        "zipf": zipf,
        "batches": batches,
        "hit_rate_accesses": hit_rate_batches * batch,
        "get_keys_per_s": {
            "in_process": in_process,
            "ray_actor": actor,
            "ray_actor_default_config": actor_default,
            "redis_mget": redis_mget,
        },
        "ray_actor_config": f"max_direct_call_object_size={INLINE_RETURN_BYTES} (default config: 100 KiB)",
        "ratios": {
            "actor_over_redis": actor / redis_mget,
            "actor_default_config_over_redis": actor_default / redis_mget,
            "in_process_over_redis": in_process / redis_mget,
        },
        "hit_rate_at_10pct_capacity": hit_rates,
        "machine": machine(),
    }


def _actor_throughput(vectors, all_keys, workload, inline_bytes) -> float:
    """Through a fresh local Ray cluster; `inline_bytes` raises Ray's inline-return limit (see cache.actor)."""
    import ray

    from genrec.cache.actor import EmbeddingCache
    from genrec.cache.config import CacheConfig

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        system_config = {"max_direct_call_object_size": inline_bytes} if inline_bytes else None
        # A Ray of the bench's own, never a `ray start` cluster running beside it (ray.init() would join that).
        options = dict(num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=system_config)
        ray.init(address="local", **options)
    try:
        config = CacheConfig(name=f"bench-{os.getpid()}", dim=vectors.shape[1], capacity=len(all_keys), store="none")
        cache = EmbeddingCache.connect(config, namespace=None)
        _fill(cache.put, all_keys, vectors, 50_000)
        rate = _throughput(cache.get, workload)
        for a in cache.actors:
            ray.kill(a)
        return rate
    finally:
        if started:
            ray.shutdown()


def _hit_rate(policy, vectors, capacity, workload) -> float:
    table = EmbeddingTable(vectors.shape[1], capacity, policy=policy, store=ArrayStore(vectors))
    warm = len(workload) // 5
    for b in workload[:warm]:
        table.get(b)
    hits, misses = table.stats.hits, table.stats.misses
    for b in workload[warm:]:
        table.get(b)
    return (table.stats.hits - hits) / ((table.stats.hits - hits) + (table.stats.misses - misses))


class LocalRedis:
    """`with LocalRedis() as url:` starts redis-server, then stops it."""

    def __init__(self):
        self.server: subprocess.Popen | None = None
        self.workdir: str | None = None

    def __enter__(self) -> str:
        binary = redis_server()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.workdir = tempfile.mkdtemp(prefix="genrec-redis-")
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes"]
        args += ["--appendfsync", "always"]  # what genrec's RedisStore promises: a put durable when it returns
        self.server = subprocess.Popen(
            [*args, "--dir", self.workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            _wait_for(port)
        except BaseException:
            self.__exit__()
            raise
        return f"redis://127.0.0.1:{port}/0"

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.terminate()
            try:
                self.server.wait(10)
            except subprocess.TimeoutExpired:  # busy (an append-only-file rewrite, say): never left running
                self.server.kill()
                self.server.wait(10)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def redis_server() -> str:
    """The redis-server on the PATH; a GenrecError (the CLI's one `error:` line, exit 2) when there is none."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise GenrecError(
            "redis-server not found on the PATH: install it (e.g. apt-get install redis-server) or pass "
            "--redis-url redis://HOST:PORT/0 to use a running one"
        )
    return binary


def _wait_for(port: int, seconds: float = 10.0) -> None:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + seconds
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
