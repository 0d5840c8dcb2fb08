"""A vectorised open-addressing hash index: int64 key -> row, batched. Linear probing at load <= 0.25 (4 slots per
key: a few probe steps even in a batch's worst case); each operation loops over probe depth only, every step one
numpy operation over the batch's unresolved keys.
"""

from __future__ import annotations

import numpy as np

from genrec.cache.keys import EMPTY, TOMBSTONE, mix64


class HashIndex:
    def __init__(self, capacity: int):
        size = 1
        while size < 4 * max(capacity, 1):
            size *= 2
        self.mask = np.uint64(size - 1)
        self.keys = np.full(size, EMPTY, dtype=np.int64)
        self.rows = np.full(size, -1, dtype=np.int64)
        self.tombstones = 0

    def _start(self, keys: np.ndarray) -> np.ndarray:
        return (mix64(keys) & self.mask).astype(np.int64)

    def slots_of(self, keys: np.ndarray) -> np.ndarray:
        """The slot holding each key, or -1."""
        slot = self._start(keys)
        found = np.full(len(keys), -1, dtype=np.int64)
        pending = np.arange(len(keys))
        size = len(self.keys)
        while pending.size:
            seen = self.keys[slot[pending]]
            hit = seen == keys[pending]
            found[pending[hit]] = slot[pending[hit]]
            pending = pending[~(hit | (seen == EMPTY))]
            slot[pending] = (slot[pending] + 1) % size
        return found

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The row of each key, or -1."""
        slots = self.slots_of(keys)
        return np.where(slots >= 0, self.rows[np.maximum(slots, 0)], -1)

    def insert(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Add keys that are unique and absent."""
        slot = self._start(keys)
        pending = np.arange(len(keys))
        size = len(self.keys)
        while pending.size:
            here = slot[pending]
            seen = self.keys[here]
            free = (seen == EMPTY) | (seen == TOMBSTONE)
            claim, first = np.unique(here[free], return_index=True)  # one winner per free slot
            winners = pending[free][first]
            self.tombstones -= int((self.keys[claim] == TOMBSTONE).sum())
            self.keys[claim] = keys[winners]
            self.rows[claim] = rows[winners]
            placed = np.zeros(len(keys), dtype=bool)
            placed[winners] = True
            pending = pending[~placed[pending]]
            slot[pending] = (slot[pending] + 1) % size

    def remove(self, keys: np.ndarray) -> None:
        slots = self.slots_of(keys)
        slots = slots[slots >= 0]
        self.keys[slots] = TOMBSTONE
        self.rows[slots] = -1
        self.tombstones += len(slots)
        if self.tombstones > len(self.keys) // 4:
            self._rebuild()

    def _rebuild(self) -> None:
        live = (self.keys != EMPTY) & (self.keys != TOMBSTONE)
        keys, rows = self.keys[live], self.rows[live]
        self.keys.fill(EMPTY)
        self.rows.fill(-1)
        self.tombstones = 0
        self.insert(keys, rows)
