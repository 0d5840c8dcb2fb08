"""EmbeddingTable: a bounded in-process table of user vectors with score-based eviction and admission, batched on
numpy arrays with no Python work per key (like DynamicEmb / HierarchicalKV's hash tables, on the host). Read-through,
write-through and admission: docs/serving.md, 'User vectors: the embedding cache'. Not thread-safe: one caller at a
time (the Ray actor serialises its callers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from genrec.cache.hash_index import HashIndex
from genrec.cache.keys import EMPTY, check_dim, checked_batch, normalize_keys
from genrec.cache.policies import POLICIES, Admission, make_policy
from genrec.errors import CacheError


@dataclass
class TableStats:
    hits: int = 0
    misses: int = 0
    store_hits: int = 0
    evictions: int = 0
    admissions_refused: int = 0

    def as_dict(self) -> dict:
        looked_up = self.hits + self.misses
        return {**self.__dict__, "hit_rate": self.hits / looked_up if looked_up else None}


class EmbeddingTable:
    def __init__(
        self,
        dim: int,
        capacity: int,
        policy: str = "lru",
        admit_after: int = 1,
        store=None,
        **policy_options,
    ):
        check_table_options(dim, capacity, policy, admit_after)
        if store is not None and store.dim != dim:
            raise CacheError(f"the store holds {store.dim}-d vectors, the table {dim}-d")
        self.dim, self.capacity, self.store = int(dim), int(capacity), store
        self.values = np.zeros((capacity, dim), dtype=np.float32)
        self.row_key = np.full(capacity, EMPTY, dtype=np.int64)
        self.index = HashIndex(capacity)
        self.policy = make_policy(policy, capacity, **policy_options)
        self.admission = Admission(admit_after)
        self.free = np.arange(capacity - 1, -1, -1)  # a stack of unused rows
        self.free_top = capacity
        self.tick = 0
        self.stats = TableStats()

    def __len__(self) -> int:
        return self.capacity - self.free_top

    def get(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """(vectors [n, dim] float32, found [n] bool); unknown IDs give zeros and found=False."""
        keys = normalize_keys(ids)
        self.tick += 1
        rows = self.index.lookup(keys)
        hit = rows >= 0
        hits = int(hit.sum())
        self.stats.hits += hits
        self.stats.misses += len(keys) - hits
        if hits == len(keys):  # the hot path: one gather
            self.policy.touch(rows, self.tick)
            return self.values.take(rows, axis=0), hit
        out = np.zeros((len(keys), self.dim), dtype=np.float32)
        out[hit] = self.values[rows[hit]]
        self.policy.touch(rows[hit], self.tick)
        found = hit.copy()
        self._read_through(keys, hit, out, found)
        return out, found

    def _read_through(self, keys, hit, out, found) -> None:
        if self.store is None:
            return
        missing, inverse = np.unique(keys[~hit], return_inverse=True)
        vectors, in_store = self.store.get_many(missing)
        self.stats.store_hits += int(in_store.sum())
        positions = np.flatnonzero(~hit)
        out[positions] = vectors[inverse]
        found[positions] = in_store[inverse]
        self._offer(missing[in_store], vectors[in_store])

    def put(self, ids, vectors) -> int:
        """Write through to the store first; of duplicate IDs the last wins. Returns the distinct keys written."""
        keys, matrix = checked_batch(ids, vectors, self.dim)
        if len(keys) == 0:
            return 0
        keys, matrix = _last_wins(keys, matrix)
        if self.store is not None:
            self.store.put_many(keys, matrix)
        self.tick += 1
        rows = self.index.lookup(keys)
        resident = rows >= 0
        self.values[rows[resident]] = matrix[resident]
        self.policy.touch(rows[resident], self.tick)
        self._insert(keys[~resident], matrix[~resident])  # a write bypasses admission
        return len(keys)

    def _offer(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Fill the table with read-through keys that pass admission."""
        if len(keys) == 0:
            return
        admitted = self.admission.record_and_admit(keys)
        self.stats.admissions_refused += int((~admitted).sum())
        self._insert(keys[admitted], vectors[admitted])

    def _insert(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Insert absent, unique keys, evicting the lowest-scoring rows when full."""
        keys, vectors = keys[-self.capacity :], vectors[-self.capacity :]
        if len(keys) == 0:
            return
        rows = self._take_rows(len(keys))
        self.values[rows] = vectors
        self.row_key[rows] = keys
        self.index.insert(keys, rows)
        self.policy.reset(rows, self.tick)
        self.policy.touch(rows, self.tick)

    def _take_rows(self, n: int) -> np.ndarray:
        from_free = min(n, self.free_top)
        rows = self.free[self.free_top - from_free : self.free_top].copy()
        self.free_top -= from_free
        if from_free < n:
            rows = np.concatenate([rows, self._evict(n - from_free)])
        return rows

    def _evict(self, n: int) -> np.ndarray:
        occupied = np.flatnonzero(self.row_key != EMPTY)
        older = occupied[self.policy.last[occupied] < self.tick]
        if len(older) >= n:  # rows this very batch wrote or read stay (a put's own keys survive its inserts)
            occupied = older
        scores = self.policy.scores(occupied, self.tick)
        victims = occupied[np.argpartition(scores, n - 1)[:n]] if n < len(occupied) else occupied
        self.index.remove(self.row_key[victims])
        self.row_key[victims] = EMPTY
        self.stats.evictions += len(victims)
        return victims

    def resident_keys(self) -> np.ndarray:
        return self.row_key[self.row_key != EMPTY]


def check_table_options(dim, capacity, policy, admit_after) -> None:
    check_dim(dim)
    for name, value in (("capacity", capacity), ("admit_after", admit_after)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise CacheError(f"{name} must be a positive integer, got {value!r}")
    if policy not in POLICIES:
        raise CacheError(f"unknown eviction policy {policy!r}; choose one of {sorted(POLICIES)}")


def _last_wins(keys: np.ndarray, matrix: np.ndarray):
    """Keep the last occurrence of each key, in first-seen order of those survivors."""
    reversed_keys = keys[::-1]
    _, first_in_reversed = np.unique(reversed_keys, return_index=True)
    keep = np.sort(len(keys) - 1 - first_in_reversed)
    return keys[keep], matrix[keep]
