"""Context that outlives a request: prompts' K/V kept by content, reused in place by later prompts that start alike.

A prompt is cut into whole blocks of BLOCK tokens, each keyed by a hash chain: key(i) = H(key(i-1), tokens of
block i [, the request's scope] [, a digest of the user embedding if the block holds the soft-token placeholder]),
seeded with the model version. A key stands for the whole prefix up to its block, so an edited, deduplicated or
re-tokenized history is a miss from the first changed block on, never a wrong hit; and a soft token ties every
later block to its embedding.

Reuse is scoped, so that how fast a prompt is answered tells nobody what another user sent (a timing side channel):
a block wholly inside the request's `shared_prefix` is keyed by content alone (public: any request may reuse it);
every later block's key includes the request's `cache_scope` (only requests of the same scope reuse it). A request
without a scope is private: its blocks past the shared prefix are keyed as if with a fresh nonce, which no later
request could match, so they are neither computed nor handed to the cache.

After its prefill, a request hands its own extent (the K/V of the prompt past its reused prefix) to the cache,
which keys its whole blocks. A later prompt reads its longest cached prefix as at most MAX_SPANS - 1 pieces of
the pool, without copying or recomputing them, and prefills the rest at the positions that follow. Where each piece
costs the request's passes a fixed overhead (the HSTU ranker's: one attention call per piece and layer), it reads
only the first pieces that gain more than they cost (`gain`, genrec.engine.pass_cost.PassCost.reuse_gain), maybe
none: on a GPU a short history is recomputed faster than it is read in pieces.

Memory is the KV pool's own, counted in bytes: the cache holds at most `capacity_bytes`, and admission of a
request that does not fit takes entries back first. An entry a running request reads is never taken. Eviction
is segmented LRU: an entry starts on probation and is protected once a later request reuses it; probation is
emptied first, so a stream of one-off prompts cannot flush the prefixes of returning users.

A second tier (HostTier) keeps entries evicted from the KV pool in host memory, by the same keys. A spill copies an
entry's whole blocks to host memory (pinned on CUDA, asynchronously, in stream order, so the pool extent may be
reused at once); a later request whose prefix reaches a spilled block copies the entry back into a fresh pool
extent before it reads it. Host bytes are bounded, least recently spilled out first. On the CPU the pool already is
host memory, so this tier buys nothing there: it is off unless sized (`host_cache_bytes`), and like every CUDA-only
path it stays off by default until a GPU run has verified it.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Self

import numpy as np
import torch

from genrec.model.kv_pool import MAX_SPANS, ContextKV, Extent, KVPool, Piece

BLOCK = 16  # tokens per block: the unit of reuse


@dataclass(frozen=True)
class Scope:
    """Who may reuse a request's blocks: requests of scope `name` (None: no other request), except those wholly
    inside its first `shared` rows (tokens, or events), which any request may reuse."""

    name: str | None
    shared: int = 0

    @classmethod
    def of(cls, request) -> Self:
        """A request's scope, from its `cache_scope` and `shared_prefix` (every request kind has both)."""
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
        """`host`: a second tier that evicted entries spill to (HostTier, below), or None. `gain(tokens, pieces)`:
        what reading a prefix of `tokens` tokens in `pieces` pieces gains a request (positive: it pays); None: the
        longest prefix always does."""
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

    def lookup(self, keys: list[bytes], max_blocks: int) -> list[Piece]:
        """The cached prefix of at most `max_blocks` blocks that gains most (the longest, unless its last pieces
        cost more than they save: `gain`), as pool pieces (adjacent blocks of one entry merge), at most
        MAX_SPANS - 1 of them. Each piece's extent is retained for the caller."""
        runs = self._runs(keys[:max_blocks])
        runs = runs[: self._paying(runs)]
        for entry, _, _ in runs:
            self._touch(entry)
        return [Piece(entry.extent.retain(), start, length) for entry, start, length in runs]  # held from here

    def _runs(self, keys: list[bytes]) -> list[tuple[_Entry, int, int]]:
        """The longest cached prefix of these keys as (entry, pool offset, tokens) runs, at most MAX_SPANS - 1."""
        runs: list[tuple[_Entry, int, int]] = []
        for key in keys:
            found = self._blocks.get(key) or self._restore(key)
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

    def evict_one(self) -> bool:
        """Give back the least recently used entry no running request reads (probation first). False if none."""
        for segment in (self._probation, self._protected):
            for entry in segment:
                if entry.extent.holders == 1:  # the cache's own hold only
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
        if self.host is not None and self.host.spill(entry.keys, entry.extent, len(entry.keys) * BLOCK):
            self.stats.spills += 1
        entry.extent.release()

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
        """Give back every entry no running request reads."""
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
