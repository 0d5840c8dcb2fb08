"""What a pass costs, in token-equivalents, the unit of the pass budgets (docs/engine.md, 'Pass budgets and
deadlines'): a token's projections and MLPs in every layer, plus K / span for attending K keys. Two spans: context
(rows over their pooled context, prefill chunks over their prompt) and own (a scoring row over its padded width,
dense: rows x width x width).

Efficiencies fitted on this repository's CPU (process CPU time, one thread): seconds = a x tokens + b x token-keys
per kind, span = a / b, over scoring passes of L = 4-4096 row tokens on C = 16-4096 context tokens (`tiny`,
`realistic`) and HSTU passes of 256-4096 rows over 16-4000 events (`tiny` HSTU); `genrec bench deadline` checks one
number fits them all. `piece_cost` (from CALL_FLOPS) is what one more reused prefix piece costs; `reuse_gain` weighs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Context attention ran at its FLOPs ratio (span 1750 measured / 1536 from FLOPs on `tiny`, 3010 / 3072 on
# `realistic`); a row's own attention about 6x slower per key (270 / 1536, 509 / 3072: float32 scores, mask, exp
# over every pair); HSTU's SiLU attention about half its ratio (300-490 / 640).
CONTEXT_EFFICIENCY = 1.0
OWN_EFFICIENCY = 1 / 6
HSTU_EFFICIENCY = 0.5

# A device's fixed cost of one more attention call (its kernel launches and the Python around them), as the FLOPs the
# device runs in that time: seconds per call x sustained FLOP/s. CUDA: ~150 µs x ~200 TFLOP/s (one H200: the `tiny`
# HSTU's returning user, 2,000 events read in 3 pieces, ran 0.6-0.7x as fast as recomputing them, ~4 ms more over
# 24 more calls). Other devices count it as nothing: on the CPU a call costs ~40 µs x ~60 GFLOP/s (this repository's
# development machine, one thread), under 10 token-equivalents of the `tiny` HSTU, less than one 16-event block's
# prefill, so any piece pays there (only toy models far smaller than `tiny` would recompute).
CALL_FLOPS = {"cuda": 3e10}
# The passes of a returning user's rank request that read its history: the prefill of its new events and one pass of
# its candidates (more only when they exceed `score_max_tokens`).
HSTU_HISTORY_READS = 2


@dataclass(frozen=True)
class PassCost:
    context_span: float  # context keys that cost one token-equivalent per query token
    own_span: float  # own keys that cost one token-equivalent per query token
    piece_cost: float = 0.0  # what one more reused prefix piece costs a request's passes (0: nothing)

    @classmethod
    def qwen3(cls, config) -> PassCost:
        """Per token and layer: q, k, v, o projections and the gated MLP; per key: q.k and p.v over every head."""
        heads, kv_heads, head_dim, hidden = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.hidden_size,
        )
        per_token = hidden * (2 * heads + 2 * kv_heads) * head_dim + 3 * hidden * config.intermediate_size
        span = per_token / (2 * heads * head_dim)
        return cls(span * CONTEXT_EFFICIENCY, span * OWN_EFFICIENCY)

    @classmethod
    def hstu(cls, config, device_type: str = "cpu") -> PassCost:
        """Per row and layer: the u, v, q, k and output projections; per key: q.k and the SiLU-weighted v.
        `piece_cost`: HSTU_HISTORY_READS more calls per layer, CALL_FLOPS over a token-equivalent's (layers cancel)."""
        width = config.num_attention_heads * config.head_dim
        per_token = 5 * config.hidden_size * width  # multiply-adds per row and layer
        span = per_token / (2 * width) * HSTU_EFFICIENCY
        call = CALL_FLOPS.get(device_type, 0.0)
        return cls(span, span, HSTU_HISTORY_READS * call / (2 * per_token))

    def rows(self, count: int, width: int, context_keys: int) -> float:
        """`count` rows padded to `width` tokens, over contexts of `context_keys` keys in all (summed over rows)."""
        return count * width * (1 + width / self.own_span) + width * context_keys / self.context_span

    def longest_row(self, budget: float) -> int:
        """The longest row that alone, over no context, costs at most `budget`."""
        n = int(self.own_span * (math.sqrt(1 + 4 * budget / self.own_span) - 1) / 2)  # root of n + n²/span = budget
        return _settle(n, lambda m: self.rows(1, m, 0) <= budget)

    def prefill(self, start: int, tokens: int) -> float:
        """A prefill chunk of `tokens` after `start` context tokens (each attends to those and, at most, the chunk)."""
        return tokens * (1 + (start + tokens) / self.context_span)

    def reuse_gain(self, tokens: int, pieces: int) -> float:
        """Reading `tokens` cached tokens in `pieces` pieces over prefilling them (positive: the reuse pays)."""
        return self.prefill(0, tokens) - pieces * self.piece_cost

    def prefill_fits(self, start: int, budget: float) -> int:
        """The most tokens a chunk after `start` can take within `budget`."""
        a = 1 + start / self.context_span  # n * a + n² / span = budget
        n = int(self.context_span * (math.sqrt(a * a + 4 * budget / self.context_span) - a) / 2)
        return _settle(n, lambda m: self.prefill(start, m) <= budget)


def _settle(n: int, fits) -> int:
    """The largest m >= 0 with fits(m), from an estimate n that float rounding may have put one off."""
    n = max(n, 0)
    while fits(n + 1):
        n += 1
    while n > 0 and not fits(n):
        n -= 1
    return n
