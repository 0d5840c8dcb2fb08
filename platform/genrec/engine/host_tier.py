"""The prefix cache's second tier: entries evicted from the KV pool, kept in host memory by the same keys.

A spill copies an entry's whole blocks to host memory (pinned on CUDA, asynchronously, in stream order, so the
pool extent may be reused at once); a later request whose prefix reaches a spilled block copies the entry back
into a fresh pool extent before it reads it. Host bytes are bounded, least recently spilled out first. On the CPU
the pool already is host memory, so this tier buys nothing there: it is off unless sized (`host_cache_bytes`),
and like every CUDA-only path it stays off by default until a GPU run has verified it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from genrec.model.kv_pool import Extent, KVPool


@dataclass(eq=False)
class HostEntry:
    keys: list[bytes]
    k: torch.Tensor  # [layers, tokens, kv_heads, head_dim] on the host
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class HostTier:
    def __init__(self, capacity_bytes: int, pool: KVPool):
        self.capacity_bytes, self.pool = capacity_bytes, pool
        self._entries: OrderedDict[HostEntry, None] = OrderedDict()  # least recently spilled first
        self._blocks: dict[bytes, HostEntry] = {}
        self.bytes = 0
        self.restores = 0

    def spill(self, keys: list[bytes], extent: Extent, tokens: int) -> bool:
        """Keep the first `tokens` tokens of the extent (the keyed blocks) under `keys`; False if it cannot fit."""
        pinned = extent.pool.k.device.type == "cuda"
        shape = (extent.pool.k.shape[0], tokens, *extent.pool.k.shape[2:])
        if 2 * extent.pool.k.element_size() * shape[0] * tokens * shape[2] * shape[3] > self.capacity_bytes:
            return False
        k = torch.empty(shape, dtype=extent.pool.k.dtype, pin_memory=pinned)
        v = torch.empty(shape, dtype=extent.pool.v.dtype, pin_memory=pinned)
        k.copy_(extent.k()[:, :tokens], non_blocking=pinned)
        v.copy_(extent.v()[:, :tokens], non_blocking=pinned)
        entry = HostEntry(keys, k, v)
        for key in keys:
            self._blocks[key] = entry
        self._entries[entry] = None
        self.bytes += entry.nbytes
        while self.bytes > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def find(self, key: bytes) -> HostEntry | None:
        return self._blocks.get(key)

    def restore(self, entry: HostEntry) -> Extent | None:
        """The entry copied back into a new extent of the pool (None when the pool has no room): it leaves the tier."""
        extent = self.pool.reserve(entry.k.shape[1])
        if extent is None:
            return None
        pinned = extent.pool.k.device.type == "cuda"
        extent.k().copy_(entry.k, non_blocking=pinned)  # in stream order: before any pass that reads it
        extent.v().copy_(entry.v, non_blocking=pinned)
        self._drop(entry)
        self.restores += 1
        return extent

    def _drop(self, entry: HostEntry) -> None:
        del self._entries[entry]
        for key in entry.keys:
            if self._blocks.get(key) is entry:
                del self._blocks[key]
        self.bytes -= entry.nbytes
