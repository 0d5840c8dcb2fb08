"""The KV budget is the pool: admission takes real extents of the engine's preallocated KVPool.

A job holds its ContextKV (unless a cached one is shared) and a second extent for the rest of what it may
hold at its peak: its BeamKV slots plus headroom for its rows (`request_kv_tokens`). Both come back when it
ends. A job that does not fit waits; the context cache gives up its least recently used prompts first.
"""

from __future__ import annotations

from dataclasses import dataclass

from genrec.engine.prepared import Prepared
from genrec.model.config import Qwen3Config
from genrec.model.kv_pool import ContextKV, Extent, KVPool


@dataclass
class Holding:
    """What one admitted job holds in the pool."""

    ctx: ContextKV  # its own, or a retained cached one
    rest: Extent  # BeamKV slots and row headroom
    tokens: int  # pool tokens this job took (a shared cached context is not counted)


class KVBudget:
    def __init__(self, pool: KVPool):
        self.pool = pool
        self.capacity = pool.tokens * pool.bytes_per_token
        self.reserved = 0  # bytes held by admitted jobs

    def admit(self, tokens: int, prompt_tokens: int, cached: ContextKV | None = None) -> Holding | None:
        """Extents for a job of `tokens` pool tokens at its peak (its prompt first), or None if they do not fit."""
        ctx = cached.retain() if cached is not None else self.pool.context(prompt_tokens)
        if ctx is None:
            return None
        rest = self.pool.reserve(tokens - prompt_tokens)
        if rest is None:
            ctx.release()
            return None
        taken = tokens if cached is None else tokens - prompt_tokens
        self.reserved += taken * self.pool.bytes_per_token
        return Holding(ctx, rest, taken)

    def release(self, holding: Holding) -> None:
        holding.ctx.release()
        holding.rest.release()
        self.reserved -= holding.tokens * self.pool.bytes_per_token
        assert self.reserved >= 0, "KV budget released more than it reserved"


def kv_bytes_per_token(config: Qwen3Config, element_size: int) -> int:
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element_size


def request_kv_tokens(prepared: Prepared, levels: int) -> int:
    """Token-equivalents of KV a request holds at its peak: prompt, beam suffixes, candidate rows."""
    tokens = len(prepared.token_ids)
    if prepared.uses_beams:
        tokens += prepared.request.beam_width * levels * 2  # BeamKV plus the gathered suffix of a pass
    if prepared.candidate_tokens is not None:
        tokens += sum(map(len, prepared.candidate_tokens))
        if prepared.kind == "recommend":
            tokens += prepared.request.num_results * levels
    return tokens
