"""Admission: a key enters the table only after `threshold` misses, counted in a count-min sketch.

The sketch may over-count (a key can be admitted a little early), never under-count.
"""

from __future__ import annotations

import numpy as np

from genrec.cache.keys import mix64

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
