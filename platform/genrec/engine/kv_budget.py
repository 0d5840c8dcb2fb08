"""The KV budget is the pool: admission takes real extents of the engine's preallocated KVPool.

A job holds its ContextKV (the pieces of a reused prefix, and its own extent for the rest of its prompt) and a
second extent for the rest of what it may hold at its peak: its BeamKV slots plus headroom for its rows (its
family reckons them: `Prepared.kv_tokens`). Both come back when it ends. A job that does not fit waits; the
prefix cache gives up its least recently used entries first.
"""

from __future__ import annotations

from dataclasses import dataclass

from genrec.model.kv_pool import ContextKV, Extent, KVPool, Piece


@dataclass
class Holding:
    """What one admitted job holds in the pool."""

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
