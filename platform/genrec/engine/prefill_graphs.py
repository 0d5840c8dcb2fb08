"""Prefill passes replayed as CUDA graphs, piecewise: each stage between two attention calls (`Qwen3.prefill_stage`)
is one graph per token bucket (docs/engine.md, 'KV memory and the execution plan'). Not captured whole: a pass's
token count varies and its attention reads index tables the host builds per pass. A pass replays the smallest bucket
holding it: 29 graph launches and 28 attention calls for 28 layers, not ~400 kernels. Each stage writes its layer's
K/V into the engine's pool inside the graph, at the slots the pass fills in before its first replay; the rows past
the pass (zeroed) write the pool's scratch slot, never a context's. Captured at engine start only;
a pass larger than every bucket, or writing another pool, runs eagerly (`qwen3.EagerStages`: the same stages).
"""

from __future__ import annotations

import torch

from genrec.model.fused import Pieces
from genrec.model.kv_pool import KVPool


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
    """A prefill's stages captured per token bucket over the largest bucket's buffers (smaller: their first rows),
    writing the K/V of `pool` (the engine's)."""

    def __init__(self, model, ops: Pieces, max_tokens: int, session, pool: KVPool):
        """`session`: the start-up capture session (genrec.engine.plan.CudaCapture, or a tests' stand-in)."""
        c, dtype, device = model.config, model.dtype, model.device
        self.model, self.ops, self.layers, self.pool = model, ops, c.num_hidden_layers, pool
        self.buckets = token_buckets(max_tokens)
        T, H, D = self.buckets[-1], c.num_attention_heads, c.head_dim
        zeros = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        self.x, self.attn, self.cos, self.sin = zeros(T, c.hidden_size), zeros(T, H, D), zeros(T, D), zeros(T, D)
        self.q = zeros(T, H, D)
        self.slots = torch.full((T,), pool.scratch, dtype=torch.int64, device=device)
        self.graphs = {}
        for bucket in reversed(self.buckets):  # largest first: the session's one memory pool serves all
            stages = range(self.layers + 1)
            self.graphs[bucket] = [session.graph(lambda i=i, b=bucket: self._stage(i, b)) for i in stages]

    def stages(self, tokens: int, writes: list) -> BucketStages | None:
        """The replays of a pass of `tokens` whose K/V `writes` (qwen3's: (pool, slots, token rows or None)) all go
        to the captured pool; None where no bucket holds it."""
        if tokens > self.buckets[-1] or len(writes) != 1 or writes[0][0] is not self.pool or writes[0][2] is not None:
            return None
        return BucketStages(self, next(b for b in self.buckets if b >= tokens), tokens, writes[0][1])

    def _stage(self, i: int, bucket: int) -> None:
        """Stage i over the bucket's rows, its outputs written into the buffers (a graph's outputs stay put) and below
        the last stage layer i's K/V into the pool at `slots`."""
        rows = slice(0, bucket)
        x, q, k, v = self.model.prefill_stage(
            i, self.x[rows], self.attn[rows], self.cos[rows], self.sin[rows], self.ops
        )
        self.x[rows].copy_(x)
        if q is not None:
            self.q[rows].copy_(q)
            self.pool.k[i].index_copy_(0, self.slots[rows], k)
            self.pool.v[i].index_copy_(0, self.slots[rows], v)


class BucketStages:
    """One pass's replays of a bucket: `first` takes its inputs, `next` each attention output; both return the
    buffers (x, q) of which the pass reads its first `tokens` rows."""

    def __init__(self, graphs: PrefillGraphs, bucket: int, tokens: int, slots: torch.Tensor):
        self.g, self.bucket, self.n, self.slots = graphs, bucket, tokens, slots

    def first(self, x, cos, sin):
        g, n = self.g, self.n
        g.x[:n].copy_(x)
        g.cos[:n].copy_(cos)
        g.sin[:n].copy_(sin)
        g.slots[:n].copy_(self.slots)
        if n < self.bucket:
            g.x[n : self.bucket].zero_()  # padding rows: finite, their K/V to the scratch slot, never attended
            g.slots[n : self.bucket].fill_(g.pool.scratch)
        return self.next(0, None)

    def next(self, i: int, attn):
        g = self.g
        if attn is not None:
            g.attn[: self.n].copy_(attn)
        g.graphs[self.bucket][i].replay()
        return g.x, g.q
