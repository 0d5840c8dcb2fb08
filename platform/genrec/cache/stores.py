"""Backing stores behind one small protocol, plus a bulk load from Parquet.

* SQLiteStore: the embedded default. One local file; WAL with synchronous=FULL and one transaction
  per batch, so a `put_many` that returned survives a crash of the process or the machine.
* RedisStore: a real Redis server; one MGET / one pipelined MSET per batch.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow.parquet as pq

from genrec.cache.keys import normalize_keys


class Store(Protocol):
    dim: int

    def get_many(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """keys [n] int64 -> (vectors [n, dim] float32, found [n] bool)."""

    def put_many(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Durable when it returns (as durable as the store is)."""

    def close(self) -> None: ...


class SQLiteStore:
    _CHUNK = 900  # SQLite's bound-parameter limit is 999 on older builds

    def __init__(self, path: str | Path, dim: int):
        self.path, self.dim = str(path), dim
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("CREATE TABLE IF NOT EXISTS embeddings (key INTEGER PRIMARY KEY, vec BLOB NOT NULL)")

    def get_many(self, keys):
        keys = np.asarray(keys, dtype=np.int64)
        out = np.zeros((len(keys), self.dim), dtype=np.float32)
        found = np.zeros(len(keys), dtype=bool)
        position = {k: i for i, k in enumerate(keys.tolist())}
        for start in range(0, len(keys), self._CHUNK):
            chunk = keys[start : start + self._CHUNK].tolist()
            marks = ",".join("?" * len(chunk))
            for key, blob in self._db.execute(f"SELECT key, vec FROM embeddings WHERE key IN ({marks})", chunk):
                i = position[key]
                out[i] = np.frombuffer(blob, dtype=np.float32)
                found[i] = True
        return out, found

    def put_many(self, keys, vectors):
        rows = zip(np.asarray(keys, dtype=np.int64).tolist(), map(bytes, np.asarray(vectors, np.float32)), strict=True)
        with self._db:  # one transaction: committed (and fsynced) before we return
            self._db.execute("BEGIN")
            self._db.executemany("INSERT OR REPLACE INTO embeddings (key, vec) VALUES (?, ?)", rows)

    def count(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM embeddings").fetchone()[0]

    def close(self):
        self._db.close()


class RedisStore:
    def __init__(self, url: str, dim: int, prefix: str = "genrec:emb:"):
        import redis

        self.dim, self.prefix = dim, prefix
        self._redis = redis.Redis.from_url(url)

    def _names(self, keys) -> list[str]:
        return [f"{self.prefix}{k}" for k in np.asarray(keys, dtype=np.int64).tolist()]

    def get_many(self, keys):
        out = np.zeros((len(keys), self.dim), dtype=np.float32)
        found = np.zeros(len(keys), dtype=bool)
        if len(keys) == 0:
            return out, found
        blobs = self._redis.mget(self._names(keys))
        found = np.fromiter((b is not None for b in blobs), dtype=bool, count=len(blobs))
        if found.any():  # one buffer for all found rows, not one array per key
            out[found] = np.frombuffer(b"".join(b for b in blobs if b is not None), dtype=np.float32).reshape(
                -1, self.dim
            )
        return out, found

    def put_many(self, keys, vectors):
        vectors = np.asarray(vectors, dtype=np.float32)
        self._redis.mset(dict(zip(self._names(keys), map(bytes, vectors), strict=True)))

    def close(self):
        self._redis.close()


def load_parquet(path: str | Path, store: Store, batch_rows: int = 65536) -> int:
    """Bulk-load `user_id`, `embedding` (list<float>) rows into a store; returns the rows loaded."""
    parquet = pq.ParquetFile(str(path))
    for column in ("user_id", "embedding"):
        if column not in parquet.schema_arrow.names:
            raise ValueError(f"{path}: column {column!r} is missing (have {parquet.schema_arrow.names})")
    loaded = 0
    for batch in parquet.iter_batches(batch_size=batch_rows, columns=["user_id", "embedding"]):
        keys = normalize_keys(batch.column("user_id").to_numpy(zero_copy_only=False))
        embedding = batch.column("embedding")
        vectors = np.asarray(embedding.flatten().to_numpy(zero_copy_only=False), dtype=np.float32)
        if len(vectors) != len(keys) * store.dim:
            raise ValueError(f"{path}: every embedding must have {store.dim} values")
        vectors = vectors.reshape(len(keys), store.dim)
        if not np.isfinite(vectors).all():
            raise ValueError(f"{path}: embeddings contain non-finite values")
        store.put_many(keys, vectors)
        loaded += len(keys)
    return loaded
