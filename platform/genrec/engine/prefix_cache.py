"""Prompts' K/V kept by content, reused in place by later prompts that start alike (docs/engine.md, 'Returning
users: the prefix cache').

Block i's key is H(key(i-1), its tokens [, the scope's digest past the shared prefix] [, the user embedding's digest
if it holds the placeholder]), seeded with the model version. A private request's blocks past its shared prefix are
keyed by nobody, so they are neither kept nor handed to the cache. A prefix is read as at most MAX_SPANS - 1 pool
pieces, only as many as `gain` says pay. Segmented LRU in pool bytes; an entry a running request reads is never
taken. HostTier spills evicted entries to host memory (pinned, async in stream order, so the pool extent may be
reused at once); it buys nothing on the CPU and is off unless `host_cache_bytes` sizes it.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from typing import Self

import numpy as np
import torch

from genrec.model.kv_pool import MAX_SPANS, ContextKV, Extent, KVPool, Piece

log = logging.getLogger(__name__)

BLOCK = 16  # tokens per block: the unit of reuse


@dataclass(frozen=True)
class Scope:
    """Who may reuse a request's blocks: requests of scope `name` (None: no other request), except those wholly
    inside its first `shared` rows (tokens, or events), which any request may reuse."""

    name: str | None
    shared: int = 0

    @classmethod
    def of(cls, request) -> Self:
        """From `cache_scope` and `shared_prefix` (every request kind has both)."""
        return cls(request.cache_scope, request.shared_prefix)

    @property
    def digest(self) -> bytes | None:
        return None if self.name is None else _digest(b"scope\0" + self.name.encode())


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def block_keys(
    token_ids: np.ndarray, salt: bytes, placeholder_id: int | None, embedding, scope: Scope | None = None
) -> list[bytes]:
    """The chain keys of the prompt's whole blocks that another request may reuse: all of them under a named
    scope, the shared ones only for a private request. `scope` None: every block keyed by content alone."""
    n = len(token_ids) // BLOCK
    shared, scoped = n, None
    if scope is not None:
        shared, scoped = min(scope.shared // BLOCK, n), scope.digest
        n = n if scoped is not None else shared  # a private request's later blocks: reusable by nobody
    if not n:
        return []
    blocks = np.ascontiguousarray(token_ids[: n * BLOCK], dtype=np.int64).reshape(n, -1)  # a row per block
    soft = None
    if embedding is not None and placeholder_id is not None:
        soft = _digest(struct.pack(f"{len(embedding)}d", *embedding))
        holds_soft = (blocks == placeholder_id).any(axis=1)
    keys, key = [], _digest(salt)
    for i in range(n):
        h = hashlib.blake2b(key, digest_size=16)
        h.update(blocks[i].tobytes())
        if i >= shared:
            h.update(scoped)
        if soft is not None and holds_soft[i]:
            h.update(soft)
        key = h.digest()
        keys.append(key)
    return keys


@dataclass(eq=False)
class _Entry:
    """One request's own extent, held by the cache; its whole blocks are keyed."""

    extent: Extent
    keys: list[bytes]
    protected: bool = False


@dataclass
class CacheStats:
    hits: int = 0  # admitted requests that reused at least one block
    tokens_prompted: int = 0
    tokens_reused: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    spills: int = 0  # evicted entries kept by the host tier


class PrefixCache:
    def __init__(
        self,
        capacity_bytes: int,
        protected_share: float = 0.8,
        host: HostTier | None = None,
        gain: Callable[[int, int], float] | None = None,
    ):
        """`host`: the HostTier evicted entries spill to, or None. `gain(tokens, pieces)`: what reading that prefix
        gains a request (positive: it pays); None: the longest prefix always pays."""
        self.capacity_bytes, self.host, self.gain = capacity_bytes, host, gain
        self.protected_limit = int(capacity_bytes * protected_share)
        self._blocks: dict[bytes, tuple[_Entry, int]] = {}  # key -> (entry, pool offset of the block)
        self._probation: OrderedDict[_Entry, None] = OrderedDict()  # least recently used first
        self._protected: OrderedDict[_Entry, None] = OrderedDict()
        self.bytes = 0
        self.protected_bytes = 0
        self.stats = CacheStats()

    def snapshot(self) -> dict:
        entries = len(self._probation) + len(self._protected)
        held = {"bytes_held": self.bytes, "entries": entries, "capacity_bytes": self.capacity_bytes}
        if self.host is not None:
            held.update(host_bytes_held=self.host.bytes, restores=self.host.restores)
        return {**asdict(self.stats), **held}

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def lookup(self, keys: list[bytes], max_blocks: int, restore: bool = True) -> list[Piece]:
        """The cached prefix of at most `max_blocks` blocks that gains most, as at most MAX_SPANS - 1 pool pieces
        (adjacent blocks of one entry merge), each extent retained for the caller. `restore`: blocks found only in
        the host tier are copied back into the pool (else they end the prefix)."""
        runs = self._runs(keys[:max_blocks], restore)
        runs = runs[: self._paying(runs)]
        for entry, _, _ in runs:
            self._touch(entry)
        return [Piece(entry.extent.retain(), start, length) for entry, start, length in runs]  # held from here

    def _runs(self, keys: list[bytes], restore: bool) -> list[tuple[_Entry, int, int]]:
        """The longest cached prefix of these keys as (entry, pool offset, tokens) runs, at most MAX_SPANS - 1."""
        runs: list[tuple[_Entry, int, int]] = []
        for key in keys:
            found = self._blocks.get(key)
            if found is None and restore and len(runs) < MAX_SPANS - 1:  # a restored entry starts a run
                found = self._restore(key)
            if found is None:
                break
            entry, start = found
            if runs and runs[-1][0] is entry and runs[-1][1] + runs[-1][2] == start:
                runs[-1] = (entry, runs[-1][1], runs[-1][2] + BLOCK)
            elif len(runs) < MAX_SPANS - 1:
                runs.append((entry, start, BLOCK))
            else:
                break
        return runs

    def _paying(self, runs: list[tuple[_Entry, int, int]]) -> int:
        """How many of the runs to read: the count of greatest positive gain (the fewest among equals), 0 if none."""
        if self.gain is None:
            return len(runs)
        best, count, tokens = 0.0, 0, 0
        for n, (_, _, length) in enumerate(runs, start=1):
            tokens += length
            if (gain := self.gain(tokens, n)) > best:
                best, count = gain, n
        return count

    def insert(self, keys: list[bytes], ctx: ContextKV) -> None:
        """Key the whole blocks of the context's own part (its prompt fully written); the cache holds its extent."""
        if not self.enabled:
            return
        own = keys[ctx.prefix_length // BLOCK : ctx.length // BLOCK]
        if not own or all(k in self._blocks for k in own):
            return
        self._add(_Entry(ctx.extent.retain(), own))
        self.trim()

    def trim(self) -> None:
        """Back within capacity, as far as entries no running request reads allow."""
        while self.bytes > self.capacity_bytes and self.evict_one():
            pass

    def _restore(self, key: bytes) -> tuple[_Entry, int] | None:
        """A block found in the host tier: its entry copied back into the pool (and the cache) first."""
        spilled = self.host.find(key) if self.host is not None else None
        extent = self.host.restore(spilled) if spilled is not None else None
        if extent is None:
            return None
        self._add(_Entry(extent, spilled.keys))
        return self._blocks.get(key)

    def _add(self, entry: _Entry) -> None:
        for i, key in enumerate(entry.keys):
            self._blocks.setdefault(key, (entry, entry.extent.start + i * BLOCK))
        self._probation[entry] = None
        self.bytes += entry.extent.nbytes

    def extents_of(self, keys: list[bytes]) -> set[Extent]:
        """The pool extents of the cached entries holding any of these blocks."""
        return {self._blocks[key][0].extent for key in keys if key in self._blocks}

    def evict_one(self, keep: Collection[Extent] = ()) -> bool:
        """Give back the least recently used entry no running request reads (probation first), none whose extent
        is in `keep`. False if none."""
        for segment in (self._probation, self._protected):
            for entry in segment:
                if entry.extent.holders == 1 and entry.extent not in keep:  # the cache's own hold only
                    self._drop(entry, segment)
                    return True
        return False

    def _drop(self, entry: _Entry, segment: OrderedDict) -> None:
        del segment[entry]
        for key in entry.keys:
            if self._blocks.get(key, (None,))[0] is entry:
                del self._blocks[key]
        self.bytes -= entry.extent.nbytes
        if entry.protected:
            self.protected_bytes -= entry.extent.nbytes
        self.stats.evictions += 1
        self.stats.evicted_bytes += entry.extent.nbytes
        if self.host is not None and self._spill(entry):
            self.stats.spills += 1
        entry.extent.release()

    def _spill(self, entry: _Entry) -> bool:
        """The entry kept by the host tier; False where it does not fit, or where host memory is refused (pinned
        memory beyond what the machine gives: `host_cache_bytes` set too high), which drops it like a full tier."""
        try:
            return self.host.spill(entry.keys, entry.extent, len(entry.keys) * BLOCK)
        except (RuntimeError, MemoryError) as error:
            log.warning("prefix cache: an evicted entry is dropped, not kept in host memory: %s", error)
            return False

    def _touch(self, entry: _Entry) -> None:
        """A reuse: most recently used, and protected (demoting the oldest protected past their share)."""
        if entry.protected:
            self._protected.move_to_end(entry)
            return
        del self._probation[entry]
        entry.protected = True
        self._protected[entry] = None
        self.protected_bytes += entry.extent.nbytes
        while self.protected_bytes > self.protected_limit and len(self._protected) > 1:
            oldest = next(iter(self._protected))
            del self._protected[oldest]
            oldest.protected = False
            self.protected_bytes -= oldest.extent.nbytes
            self._probation[oldest] = None

    def clear(self) -> None:
        while self.evict_one():
            pass


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
