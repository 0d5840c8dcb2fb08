"""Who enters the table and who leaves it. Eviction scores: the row with the lowest score is evicted first; time is
a logical tick per batch. Admission: a key enters only after `threshold` misses, counted in a count-min sketch (it
may over-count, so a key can be admitted a little early, never under-count)."""

from __future__ import annotations

import numpy as np

from genrec.cache.keys import mix64


class EvictionPolicy:
    name = "base"

    def __init__(self, capacity: int):
        self.last = np.zeros(capacity, dtype=np.float64)  # tick of the last access
        self.count = np.zeros(capacity, dtype=np.float64)  # accesses (decayed for decayed_lfu)

    def reset(self, rows: np.ndarray, now: int) -> None:
        self.last[rows] = now
        self.count[rows] = 0.0

    def touch(self, rows: np.ndarray, now: int) -> None:
        """One access per occurrence of a row (duplicates count twice)."""
        np.add.at(self.count, rows, 1.0)
        self.last[rows] = now

    def scores(self, rows: np.ndarray, now: int) -> np.ndarray:
        raise NotImplementedError


class LRU(EvictionPolicy):
    name = "lru"

    def touch(self, rows, now):
        self.last[rows] = now

    def scores(self, rows, now):
        return self.last[rows]


class LFU(EvictionPolicy):
    name = "lfu"

    def scores(self, rows, now):
        return self.count[rows] + self.last[rows] * 1e-12  # ties: the older goes first


class DecayedLFU(EvictionPolicy):
    """Access counts that halve every `half_life` ticks: frequent *and* recent keys stay."""

    name = "decayed_lfu"

    def __init__(self, capacity: int, half_life: float = 100.0):
        super().__init__(capacity)
        self.half_life = half_life

    def _decayed(self, rows, now):
        return self.count[rows] * np.exp2(-(now - self.last[rows]) / self.half_life)

    def touch(self, rows, now):
        self.count[rows] = self._decayed(rows, now)  # same value for duplicates: decay once
        self.last[rows] = now
        np.add.at(self.count, rows, 1.0)

    def scores(self, rows, now):
        return self._decayed(rows, now)


POLICIES = {p.name: p for p in (LRU, LFU, DecayedLFU)}


def make_policy(name: str, capacity: int, **options) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name](capacity, **options)


_SEEDS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5], dtype=np.uint64)


class Admission:
    def __init__(self, threshold: int = 1, width: int = 1 << 18):
        self.threshold = threshold
        self.width = np.uint64(width)
        self.counts = np.zeros((len(_SEEDS), width), dtype=np.uint32) if threshold > 1 else None

    def record_and_admit(self, keys: np.ndarray) -> np.ndarray:
        """Count one miss for each key; True where the key has now missed `threshold` times."""
        if self.counts is None:
            return np.ones(len(keys), dtype=bool)
        estimate = np.full(len(keys), np.iinfo(np.uint32).max, dtype=np.uint64)
        for row, seed in enumerate(_SEEDS):
            with np.errstate(over="ignore"):
                column = (mix64((keys.view(np.uint64) ^ seed).view(np.int64)) % self.width).astype(np.int64)
            np.add.at(self.counts[row], column, 1)
            estimate = np.minimum(estimate, self.counts[row][column])
        return estimate >= self.threshold
