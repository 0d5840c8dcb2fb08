"""Preallocated, token-major KV memory: one pool per engine, prompts held as (offset, length) extents
(docs/design.md, 'KV layout').

k, v are [layers, tokens, kv_heads, head_dim]; a prompt's layer i is `k[i, offset : offset + length]`. An admitted job
holds its ContextKV (reused prefix pieces, then its own extent) and a second extent for the rest of its peak (BeamKV
slots and row headroom: `Prepared.kv_tokens`); both come back when it ends.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Protocol

import torch


class KVShape(Protocol):
    """What a pool needs of a model's config to hold its K/V (both families' configs have it)."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int


# The most spans a context has: up to MAX_SPANS - 1 reused prefix pieces, then its own part. A fixed number, so
# a decode pass captured as a graph has one shape whatever its contexts (see genrec.engine.prefix_cache).
MAX_SPANS = 4


class ExtentAllocator:
    """First-fit over a sorted free list of (start, length); freed neighbours coalesce at once, so a
    pool with nothing allocated is always one extent of its whole size."""

    def __init__(self, tokens: int):
        self.tokens = tokens
        self.free: list[tuple[int, int]] = [(0, tokens)] if tokens else []
        self.used = 0

    def allocate(self, n: int) -> int | None:
        """Offset of a new extent of n tokens (n >= 0), or None when no free extent is that long."""
        if n == 0:
            return 0
        for i, (start, length) in enumerate(self.free):
            if length >= n:
                if length == n:
                    del self.free[i]
                else:
                    self.free[i] = (start + n, length - n)
                self.used += n
                return start
        return None

    def release(self, start: int, n: int) -> None:
        if n == 0:
            return
        self.used -= n
        i = bisect.bisect_left(self.free, (start, 0))
        if i < len(self.free) and self.free[i][0] < start + n or i and sum(self.free[i - 1]) > start:
            raise RuntimeError(f"extent ({start}, {n}) released twice or overlaps a free one")
        if i < len(self.free) and self.free[i][0] == start + n:  # merge with the next free extent
            n += self.free.pop(i)[1]
        if i and sum(self.free[i - 1]) == start:  # and with the previous one
            start, n = self.free[i - 1][0], self.free[i - 1][1] + n
            i -= 1
            self.free.pop(i)
        self.free.insert(i, (start, n))

    @property
    def largest(self) -> int:
        return max((length for _, length in self.free), default=0)


def kv_storage(shape, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised K and V storage, written in place later: ordinary tensors even when allocated under
    inference mode (an inference tensor could not be updated in place outside it)."""
    with torch.inference_mode(False):
        return torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype)


class KVPool:
    def __init__(self, config: KVShape, tokens: int, device, dtype):
        """`tokens` slots to give out, and one more past them, `scratch`: where a captured pass's padding rows write
        their K/V (genrec.engine.prefill_graphs), never a context's and outside the budget."""
        shape = (config.num_hidden_layers, tokens + 1, config.num_key_value_heads, config.head_dim)
        self.k, self.v = kv_storage(shape, device, dtype)
        self.tokens, self.scratch = tokens, tokens
        self.bytes_per_token = 2 * shape[0] * shape[2] * shape[3] * self.k.element_size()
        self._extents = ExtentAllocator(tokens)

    def reserve(self, n: int) -> Extent | None:
        start = self._extents.allocate(n)
        if start is None:
            return None
        return Extent(self, start, n)

    def context(self, n: int) -> ContextKV | None:
        extent = self.reserve(n)
        return None if extent is None else ContextKV(extent)

    @property
    def used(self) -> int:
        """Tokens in live extents."""
        return self._extents.used


class Extent:
    """Tokens [start, start + length) of a pool, held while anyone holds it: created with one holder; `retain()`
    adds one, `release()` drops one, and the last release gives the tokens back to the pool."""

    def __init__(self, pool: KVPool, start: int, length: int):
        self.pool, self.start, self.length = pool, start, length
        self.holders = 1

    @property
    def live(self) -> bool:
        return self.holders > 0

    def retain(self) -> Extent:
        if not self.live:
            raise RuntimeError("an extent already given back cannot be held again")
        self.holders += 1
        return self

    def release(self) -> None:
        if self.live:
            self.holders -= 1
            if self.holders == 0:
                self.pool._extents.release(self.start, self.length)

    @property
    def nbytes(self) -> int:
        return self.length * self.pool.bytes_per_token

    def k(self) -> torch.Tensor:
        """[layers, length, kv_heads, head_dim] view."""
        return self.pool.k[:, self.start : self.start + self.length]

    def v(self) -> torch.Tensor:
        return self.pool.v[:, self.start : self.start + self.length]


@dataclass(frozen=True)
class Piece:
    """Tokens [start, start + length) of the pool, inside `extent`, read in place by a later prompt."""

    extent: Extent
    start: int
    length: int


class ContextKV:
    """One request's prompt K/V for every layer, in one pool: the `prefix` pieces (earlier prompts' K/V reused in
    place, read-only, held while this context lives), then its own extent, written from position `prefix_length`
    on; `length` tokens in all are ready. Shared by every row of the request: attention reads `spans()`."""

    def __init__(self, extent: Extent, prefix: list[Piece] | tuple = ()):
        self.extent = extent
        self.prefix = list(prefix)
        self.prefix_length = sum(p.length for p in self.prefix)
        self.length = self.prefix_length

    @classmethod
    def allocate(cls, config: KVShape, capacity: int, device, dtype) -> ContextKV:
        return KVPool(config, capacity, device, dtype).context(capacity)

    @property
    def pool(self) -> KVPool:
        return self.extent.pool

    def spans(self) -> list[tuple[int, int]]:
        """(pool offset, tokens) of every part, in position order: the prefix pieces, then its own written tokens."""
        return [(p.start, p.length) for p in self.prefix] + [(self.extent.start, self.length - self.prefix_length)]

    def own_offset(self, position: int) -> int:
        """Where in the pool the token at prompt `position` (>= prefix_length) of its own part lives."""
        return self.extent.start + position - self.prefix_length

    @property
    def k(self) -> torch.Tensor:
        """Its own extent's K: [layers, capacity, kv_heads, head_dim] (token-major view of the pool)."""
        return self.extent.k()

    @property
    def v(self) -> torch.Tensor:
        return self.extent.v()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's ready K/V as [kv_heads, length, head_dim]: views of the pool, or with prefix pieces a copy
        of them all concatenated (a plain view of the whole context, for references and checks)."""
        k = torch.cat([self.pool.k[i, a : a + n] for a, n in self.spans()]) if self.prefix else None
        v = torch.cat([self.pool.v[i, a : a + n] for a, n in self.spans()]) if self.prefix else None
        if not self.prefix:
            span = slice(self.extent.start, self.extent.start + self.length)
            k, v = self.pool.k[i, span], self.pool.v[i, span]
        return k.transpose(0, 1), v.transpose(0, 1)

    def release(self) -> None:
        self.extent.release()
        for piece in self.prefix:
            piece.extent.release()


@dataclass
class Holding:  # what one admitted job holds in the pool
    ctx: ContextKV  # its prompt: reused prefix pieces (held), then its own extent
    rest: Extent  # BeamKV slots and row headroom
    tokens: int  # pool tokens it took (its own extent and the rest; reused pieces are not counted)


class KVBudget:
    def __init__(self, pool: KVPool):
        self.pool = pool
        self.capacity = pool.tokens * pool.bytes_per_token
        self.reserved = 0  # bytes held by admitted jobs

    def admit(self, own_tokens: int, rest_tokens: int, prefix: list[Piece]) -> Holding | None:
        """Extents for a job's own prompt tokens (after its reused `prefix`, whose holds it takes over) and the
        rest of its peak; None if they do not fit (the caller still holds the prefix then)."""
        own = self.pool.reserve(own_tokens)
        if own is None:
            return None
        rest = self.pool.reserve(rest_tokens)
        if rest is None:
            own.release()
            return None
        self.reserved += (own_tokens + rest_tokens) * self.pool.bytes_per_token
        return Holding(ContextKV(own, prefix), rest, own_tokens + rest_tokens)

    def release(self, holding: Holding) -> None:
        holding.ctx.release()
        holding.rest.release()
        self.reserved -= holding.tokens * self.pool.bytes_per_token
        assert self.reserved >= 0, "KV budget released more than it reserved"


def kv_bytes_per_token(config, element_size: int) -> int:
    """K and V of one token in every layer (`config`: a model config with the KV shape)."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element_size
