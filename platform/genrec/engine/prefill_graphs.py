"""Prefill passes replayed as CUDA graphs, piecewise: each stage between two attention calls (`Qwen3.prefill_stage`)
is one graph per token bucket (docs/engine.md, 'KV memory and the execution plan'). Not captured whole: a pass's
token count varies and its attention reads index tables the host builds per pass. A pass replays the smallest bucket
holding it, the rows past it zeroed (never reaching a K/V write or an attention): 29 graph launches and 28 attention
calls for 28 layers, not ~400 kernels. Captured at engine start only; a pass larger than every bucket runs eagerly.
"""

from __future__ import annotations

import torch

from genrec.model.fused import Pieces


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, ... 512, then every 512 up to max_tokens (rounded up), smallest first."""
    buckets, size = [], 16
    while size < min(max_tokens, 512):
        buckets.append(size)
        size *= 2
    buckets.append(size)
    while size < max_tokens:
        size += 512
        buckets.append(size)
    return buckets


class PrefillGraphs:
    """A prefill's stages captured per token bucket over the largest bucket's buffers (smaller: their first rows)."""

    def __init__(self, model, ops: Pieces, max_tokens: int, session):
        """`session`: the start-up capture session (genrec.engine.plan.CudaCapture, or a tests' stand-in)."""
        c, dtype, device = model.config, model.dtype, model.device
        self.model, self.ops, self.layers = model, ops, c.num_hidden_layers
        self.buckets = token_buckets(max_tokens)
        T, H, KV, D = self.buckets[-1], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        zeros = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        self.x, self.attn, self.cos, self.sin = zeros(T, c.hidden_size), zeros(T, H, D), zeros(T, D), zeros(T, D)
        self.q, self.k, self.v = zeros(T, H, D), zeros(T, KV, D), zeros(T, KV, D)
        self.graphs = {}
        for bucket in reversed(self.buckets):  # largest first: the session's one memory pool serves all
            stages = range(self.layers + 1)
            self.graphs[bucket] = [session.graph(lambda i=i, b=bucket: self._stage(i, b)) for i in stages]

    def holds(self, tokens: int) -> bool:
        return tokens <= self.buckets[-1]

    def stages(self, tokens: int) -> BucketStages:
        return BucketStages(self, next(b for b in self.buckets if b >= tokens), tokens)

    def _stage(self, i: int, bucket: int) -> None:
        """Stage i over the bucket's rows, its outputs written into the buffers (a graph's outputs stay put)."""
        rows = slice(0, bucket)
        x, q, k, v = self.model.prefill_stage(
            i, self.x[rows], self.attn[rows], self.cos[rows], self.sin[rows], self.ops
        )
        self.x[rows].copy_(x)
        if q is not None:
            self.q[rows].copy_(q)
            self.k[rows].copy_(k)
            self.v[rows].copy_(v)


class BucketStages:
    """One pass's replays of a bucket: `first` takes its inputs, `next` each attention output; both return the
    buffers (x, q, k, v) of which the pass reads its first `tokens` rows."""

    def __init__(self, graphs: PrefillGraphs, bucket: int, tokens: int):
        self.g, self.bucket, self.n = graphs, bucket, tokens

    def first(self, x, cos, sin):
        g, n = self.g, self.n
        g.x[:n].copy_(x)
        g.cos[:n].copy_(cos)
        g.sin[:n].copy_(sin)
        if n < self.bucket:
            g.x[n : self.bucket].zero_()  # padding rows: finite, and never read by a K/V write or an attention
        return self.next(0, None)

    def next(self, i: int, attn):
        g = self.g
        if attn is not None:
            g.attn[: self.n].copy_(attn)
        g.graphs[self.bucket][i].replay()
        return g.x, g.q, g.k, g.v
