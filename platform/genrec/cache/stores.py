"""Backing stores behind one small protocol (docs/serving.md, 'User vectors: the embedding cache').

SQLiteStore, the embedded default: one local file, WAL with synchronous=FULL and one transaction per batch, so a
`put_many` that returned survives a crash of the process or the machine. RedisStore: one MGET / MSET per batch, the
width recorded under `{prefix}dim`. Both check every write before it reaches the store and turn a backend failure
into a `StoreError`.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from pathlib import Path
from typing import Protocol

import numpy as np

from genrec.cache.keys import check_dim, checked_batch, normalize_keys
from genrec.errors import CacheError, StoreError


class Store(Protocol):
    dim: int

    def get_many(self, keys) -> tuple[np.ndarray, np.ndarray]:
        """IDs [n] -> (vectors [n, dim] float32, found [n] bool)."""

    def put_many(self, keys, vectors) -> None:
        """Durable when it returns (as durable as the store is)."""

    def close(self) -> None: ...


class SQLiteStore:
    _CHUNK = 900  # SQLite's bound-parameter limit is 999 on older builds

    def __init__(self, path: str | Path, dim: int, owner: str | None = None):
        """`owner`: whose file it is (a cache's name and shard), recorded by the first opener and checked after."""
        self.path, self.dim = str(path), check_dim(dim)
        self._lock = threading.Lock()  # one connection, one statement or transaction at a time
        if Path(self.path).is_file() and Path(self.path).stat().st_size == 0:  # SQLite would take it for a new store
            raise StoreError(f"{self.path} is empty (0 bytes), not a store: restore it, or remove it to start anew")
        try:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        except (OSError, sqlite3.Error) as e:
            raise StoreError(f"{self.path}: cannot open ({e})") from None
        try:
            with self._using() as db:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=FULL")
                db.execute("CREATE TABLE IF NOT EXISTS embeddings (key INTEGER PRIMARY KEY, vec BLOB NOT NULL)")
                db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
                with db:
                    db.execute("BEGIN IMMEDIATE")
                    stored = self._recorded_dim(db)
                    holder = _recorded_once(db, "owner", owner) if owner is not None else None
            if stored != self.dim:
                raise StoreError(f"{self.path} holds {stored}-d vectors; it cannot be opened with dim={self.dim}")
            if holder != owner:
                raise StoreError(
                    f"{self.path} holds {holder}, not {owner}: give each cache its own store_path, and open a cache"
                    " with the shards its store was written with (or load it anew)"
                )
        except StoreError:
            self._db.close()
            raise

    def _recorded_dim(self, db) -> int:
        """The width the file records; a file without one (new, or written before the record existed)
        gets ours, once every vector in it is checked to have that width."""
        row = db.execute("SELECT value FROM meta WHERE name = 'dim'").fetchone()
        if row is not None:
            return int(row[0])
        wrong = db.execute("SELECT COUNT(*) FROM embeddings WHERE length(vec) != ?", (4 * self.dim,)).fetchone()[0]
        if wrong:
            raise StoreError(f"{self.path}: {wrong} stored vectors are not {self.dim} float32 values wide")
        db.execute("INSERT INTO meta (name, value) VALUES ('dim', ?)", (str(self.dim),))
        return self.dim

    @contextlib.contextmanager
    def _using(self):
        with self._lock:
            try:
                yield self._db
            except sqlite3.Error as e:
                raise StoreError(f"{self.path}: {e}") from None

    def get_many(self, keys):
        keys = normalize_keys(keys)
        distinct, inverse = np.unique(keys, return_inverse=True)  # a key asked twice is found twice
        rows = []
        with self._using() as db:
            for start in range(0, len(distinct), self._CHUNK):
                chunk = distinct[start : start + self._CHUNK].tolist()
                marks = ",".join("?" * len(chunk))
                rows += db.execute(f"SELECT key, vec FROM embeddings WHERE key IN ({marks})", chunk).fetchall()
        vectors = np.zeros((len(distinct), self.dim), dtype=np.float32)
        found = np.zeros(len(distinct), dtype=bool)
        if rows:
            at = np.searchsorted(distinct, np.fromiter((k for k, _ in rows), dtype=np.int64, count=len(rows)))
            vectors[at] = _rows_of(b"".join(v for _, v in rows), len(rows), self.dim, self.path)
            found[at] = True
        return vectors[inverse], found[inverse]

    def put_many(self, keys, vectors):
        keys, vectors = checked_batch(keys, vectors, self.dim)
        rows = zip(keys.tolist(), map(bytes, vectors), strict=True)
        with self._using() as db, db:  # one transaction: committed (and fsynced) before we return
            db.execute("BEGIN")
            db.executemany("INSERT OR REPLACE INTO embeddings (key, vec) VALUES (?, ?)", rows)

    def count(self) -> int:
        with self._using() as db:
            return db.execute("SELECT COUNT(*) FROM embeddings").fetchone()[0]

    def close(self):
        with self._lock:
            self._db.close()


class RedisStore:
    def __init__(
        self, url: str, dim: int, prefix: str = "genrec:emb:", connect_timeout_s: float = 5.0, owner: str | None = None
    ):
        """`owner`: whose keys these are (a cache's name), recorded by the first opener and checked after. The
        server must log every write (appendonly yes): a put is durable when it returns, or refused at open."""
        import redis

        self.url, self.dim, self.prefix = url, check_dim(dim), prefix
        try:
            self._redis = redis.Redis.from_url(url, socket_connect_timeout=connect_timeout_s)
        except ValueError as e:
            raise CacheError(f"redis_url {url!r}: {e}") from None
        try:
            with self._using() as r:  # also the reachability check: fail at open, not at the first get
                _check_logs_writes(r, url)
                r.set(f"{prefix}dim", self.dim, nx=True)  # the first opener records the width
                stored = int(r.get(f"{prefix}dim"))
                if owner is not None:
                    r.set(f"{prefix}owner", owner, nx=True)
                holder = None if owner is None else r.get(f"{prefix}owner").decode()
            if stored != self.dim:
                raise StoreError(f"{url} prefix {prefix!r} holds {stored}-d vectors; cannot open it with dim={dim}")
            if holder != owner:
                raise StoreError(
                    f"{url} prefix {prefix!r} holds cache {holder!r}, not {owner!r}: give each cache its own redis_url"
                    " database (redis://host:port/N)"
                )
        except StoreError:
            self._redis.close()
            raise

    @contextlib.contextmanager
    def _using(self):
        import redis

        try:
            yield self._redis
        except redis.RedisError as e:
            raise StoreError(f"redis at {self.url}: {e}") from None

    def _names(self, keys: np.ndarray) -> list[str]:
        return [f"{self.prefix}{k}" for k in keys.tolist()]

    def get_many(self, keys):
        keys = normalize_keys(keys)
        out = np.zeros((len(keys), self.dim), dtype=np.float32)
        if len(keys) == 0:
            return out, np.zeros(0, dtype=bool)
        with self._using() as r:
            blobs = r.mget(self._names(keys))
        found = np.fromiter((b is not None for b in blobs), dtype=bool, count=len(blobs))
        if found.any():  # one buffer for all found rows, not one array per key
            out[found] = _rows_of(b"".join(b for b in blobs if b is not None), int(found.sum()), self.dim, self.url)
        return out, found

    def put_many(self, keys, vectors):
        keys, vectors = checked_batch(keys, vectors, self.dim)
        if len(keys):
            with self._using() as r:
                r.mset(dict(zip(self._names(keys), map(bytes, vectors), strict=True)))

    def close(self):
        self._redis.close()


def _recorded_once(db, name: str, value: str) -> str:
    """The file's record of `name`: `value` if it had none (the first opener's), else what it holds."""
    db.execute("INSERT OR IGNORE INTO meta (name, value) VALUES (?, ?)", (name, value))
    return db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()[0]


def _check_logs_writes(r, url: str) -> None:
    """Refuse a server that keeps writes in memory only (no append-only file): a crash would lose acknowledged puts.
    With `appendfsync everysec` (Redis' default once the log is on) a crash of the machine loses up to a second."""
    if not int(r.info("persistence").get("aof_enabled", 0)):
        raise StoreError(
            f"redis at {url} does not log writes (appendonly no): a crash would lose acknowledged puts; set"
            " `appendonly yes` (and `appendfsync always` for no loss even on a crash of the machine)"
        )


def _rows_of(buffer: bytes, rows: int, dim: int, where: str) -> np.ndarray:
    """`rows` stored vectors, concatenated, as [rows, dim] float32; a width that differs is refused."""
    if len(buffer) != 4 * rows * dim:
        raise StoreError(f"{where}: stored vectors are not all {dim} float32 values wide (written by another client?)")
    return np.frombuffer(buffer, dtype=np.float32).reshape(rows, dim)
