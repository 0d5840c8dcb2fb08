"""An optional LRU of recent prefills keyed by the exact prompt (token IDs + user embedding).

A retrieve followed by a score for the same user prompt then prefills once. ContextKV is read-only after
prefill, so sharing it between requests is safe. Entries hold their ContextKV's extent of the KV pool
(retained, released on eviction); admission evicts the oldest when a new request does not fit.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from genrec.engine.prepared import Prepared


def context_key(prepared: Prepared) -> bytes:
    digest = hashlib.blake2b(prepared.token_ids.numpy().tobytes(), digest_size=16)
    vector = prepared.request.user_embedding
    if vector is not None:
        digest.update(struct.pack(f"{len(vector)}d", *vector))
    return digest.digest()


class ContextCache:
    def __init__(self, entries: int):
        self.entries = entries
        self._items: OrderedDict = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: bytes):
        if self.entries <= 0:
            return None
        found = self._items.get(key)
        if found is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return found

    def peek(self, key: bytes):
        """The entry, without counting a hit or refreshing it."""
        return self._items.get(key) if self.entries > 0 else None

    def put(self, key: bytes, prefilled) -> None:
        if self.entries <= 0:
            return
        if key in self._items:
            self._items.pop(key).ctx.release()
        self._items[key] = prefilled
        prefilled.ctx.retain()
        while len(self._items) > self.entries:
            self.evict_oldest()

    def evict_oldest(self) -> bool:
        """Drop the least recently used entry (its pool extent comes back once no job holds it)."""
        if not self._items:
            return False
        self._items.popitem(last=False)[1].ctx.release()
        return True

    @property
    def nbytes(self) -> int:
        return sum(p.ctx.nbytes for p in self._items.values())
