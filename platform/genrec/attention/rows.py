"""Which rows of a pass read which pooled context: worked out once per pass, read by every layer.

A context (`ContextKV`) is spans of a pool (reused prefix pieces, then its own tokens); part j of a pass is span j
of every context of one pool: one varlen call each, merged exactly. Without prefix pieces: one call per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from genrec.attention.kernels import REFERENCE, AttentionKernels
from genrec.attention.merge import merge_partials
from genrec.attention.varlen import Spans


@dataclass(frozen=True)
class ContextGroup:
    """Rows [start, stop) of a pass share one request's context (a ContextKV)."""

    start: int
    stop: int
    ctx: Any


def span_parts(contexts: list, cu_q: list[int]) -> list[tuple[Any, Spans]]:
    """(pool, Spans) per part: sequence b (queries cu_q[b]:cu_q[b+1]) reads span j of contexts[b] in part j;
    a sequence whose context is None, in another pool, or has fewer spans reads nothing there."""
    pools = list({id(c.pool): c.pool for c in contexts if c is not None}.values())
    spans = [c.spans() if c is not None else [] for c in contexts]
    parts = []
    for pool in pools:
        mine = [s if c is not None and c.pool is pool else [] for c, s in zip(contexts, spans, strict=True)]
        for j in range(max(map(len, mine))):
            starts = [s[j][0] if j < len(s) else 0 for s in mine]
            lengths = [s[j][1] if j < len(s) else 0 for s in mine]
            parts.append((pool, Spans(cu_q, starts, lengths)))
    return parts


def attend_parts(q, parts, layer: int, scale: float, kernels: AttentionKernels):
    """q [M, H, D] over every part -> (out [M, H, D], lse [H, M]); queries that read nothing get 0 and -inf."""
    out = lse = None
    for pool, spans in parts:
        o, s = kernels.varlen(q, pool.k[layer], pool.v[layer], spans, scale)
        out, lse = (o, s) if out is None else merge_partials(out, lse, o, s)
    if out is None:
        M, H, D = q.shape
        return q.new_zeros(M, H, D), torch.full((H, M), float("-inf"), device=q.device)
    return out, lse


class ContextRows:
    """The context part of a pass: every row over its group's pooled context. `groups` in any order; rows of no
    group take nothing from the context. `per_row` query positions a row; `kernels`: the plan's."""

    def __init__(self, groups: list[ContextGroup], rows: int, per_row: int = 1, kernels: AttentionKernels = REFERENCE):
        cu, ctxs = [0], []
        for g in sorted((g for g in groups if g.stop > g.start), key=lambda g: g.start):
            if g.start > cu[-1]:
                cu.append(g.start)
                ctxs.append(None)
            cu.append(g.stop)
            ctxs.append(g.ctx)
        if cu[-1] < rows:
            cu.append(rows)
            ctxs.append(None)
        self.kernels = kernels
        self.parts = span_parts(ctxs, [c * per_row for c in cu])

    def at_layer(self, i: int) -> LayerRows:
        return LayerRows(self, i)

    def attend(self, q: torch.Tensor, layer: int, scale: float):
        """q [rows * per_row, H, D] -> (out [.., H, D], lse [H, ..]) over each row's context."""
        return attend_parts(q, self.parts, layer, scale, self.kernels)


@dataclass(frozen=True)
class LayerRows:
    """One layer of `ContextRows`: what `shared_context_attention` reads."""

    rows: ContextRows
    layer: int

    def attend(self, q: torch.Tensor, scale: float):
        return self.rows.attend(q, self.layer, scale)


class PrefillRows:
    """The attention of packed prompt chunks: chunk b (queries cu_q[b]:cu_q[b+1]) sees its context's prefix pieces
    whole and its own tokens up to itself (causal, bottom-right: the chunk's tokens are the last ones written)."""

    def __init__(self, contexts: list, cu_q: list[int], kernels: AttentionKernels = REFERENCE):
        self.kernels = kernels
        own = [(c.pool, c.extent.start, c.length - c.prefix_length) for c in contexts]
        pools = list({id(p): p for p, _, _ in own}.values())

        def causal(keep) -> list:  # the chunks' own spans, of the chunks `keep` says (others: no keys)
            return [
                (
                    pool,
                    Spans(
                        cu_q,
                        [a if p is pool else 0 for p, a, _ in own],
                        [n if p is pool and k else 0 for (p, _, n), k in zip(own, keep, strict=True)],
                    ),
                )
                for pool in pools
            ]

        with_prefix = [bool(c.prefix) for c in contexts]
        # Chunks without a reused prefix need no log-sum-exp (one causal call); the others merge theirs exactly.
        self.plain = causal([not w for w in with_prefix]) if not all(with_prefix) else []
        self.merged = causal(with_prefix) if any(with_prefix) else []
        self.prefix = span_parts([_Prefix(c) if c.prefix else None for c in contexts], cu_q)

    def attend(self, q: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        """q [tokens, H, D] -> out [tokens, H, D]. Every query belongs to one chunk: its row of `out` comes from
        the plain call or from the merged ones (the other side gives it zeros)."""
        out = None
        for pool, spans in self.plain:
            o, _ = self.kernels.varlen(q, pool.k[layer], pool.v[layer], spans, scale, causal=True, need_lse=False)
            out = o if out is None else out + o
        if self.merged:
            merged, lse = attend_parts(q, self.prefix, layer, scale, self.kernels)
            for pool, spans in self.merged:
                o, s = self.kernels.varlen(q, pool.k[layer], pool.v[layer], spans, scale, causal=True)
                merged, lse = merge_partials(merged, lse, o, s)
            out = merged if out is None else out + merged
        return out


@dataclass(frozen=True)
class _Prefix:
    """A context's prefix pieces alone, as `span_parts` reads contexts."""

    ctx: Any

    @property
    def pool(self):
        return self.ctx.pool

    def spans(self) -> list[tuple[int, int]]:
        return self.ctx.spans()[:-1]
