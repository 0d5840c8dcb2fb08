"""Eviction scores: the row with the lowest score is evicted first. Time is a logical tick per batch."""

from __future__ import annotations

import numpy as np


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
