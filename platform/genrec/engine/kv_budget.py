"""Accounting of KV memory (ContextKV + BeamKV + scoring rows) against a fixed budget.

Tensors come from the framework allocator (on CUDA its caching allocator is the pool); this budget
decides admission, so the device never holds more KV than configured and a request that does not fit
waits instead of failing with out-of-memory.
"""

from __future__ import annotations

from genrec.engine.prepared import Prepared
from genrec.model.config import Qwen3Config


class KVBudget:
    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.reserved = 0

    def fits(self, nbytes: int) -> bool:
        return self.reserved + nbytes <= self.capacity

    def reserve(self, nbytes: int) -> None:
        if not self.fits(nbytes):
            raise RuntimeError("KV budget exceeded")  # callers check fits() first
        self.reserved += nbytes

    def release(self, nbytes: int) -> None:
        self.reserved -= nbytes
        assert self.reserved >= 0, "KV budget released more than it reserved"


def kv_bytes_per_token(config: Qwen3Config, element_size: int) -> int:
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element_size


def request_kv_tokens(prepared: Prepared, levels: int) -> int:
    """Token-equivalents of KV a request holds at its peak: prompt, beam suffixes, candidate rows."""
    tokens = len(prepared.token_ids)
    if prepared.beams:
        tokens += prepared.request.beam_width * levels * 2  # BeamKV plus the gathered suffix of a pass
    if prepared.candidates is not None:
        tokens += sum(map(len, prepared.candidates))
        if prepared.kind == "recommend":
            tokens += prepared.request.num_results * levels
    return tokens
