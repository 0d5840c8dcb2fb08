"""An optional LRU of recent prefills keyed by the exact prompt (token IDs + user embedding).

A retrieve followed by a score for the same user prompt then prefills once. ContextKV is read-only after
prefill, so sharing it between requests is safe. Entries live outside the KV budget; size it in entries.
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

    def put(self, key: bytes, prefilled) -> None:
        if self.entries <= 0:
            return
        self._items[key] = prefilled
        self._items.move_to_end(key)
        while len(self._items) > self.entries:
            self._items.popitem(last=False)

    @property
    def nbytes(self) -> int:
        return sum(p.ctx.nbytes for p in self._items.values())
