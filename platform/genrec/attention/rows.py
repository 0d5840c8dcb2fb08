"""Which rows of a pass read which pooled context: worked out once per pass, read by every layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from genrec.attention.varlen import Spans, varlen_attention


@dataclass(frozen=True)
class ContextGroup:
    """Rows [start, stop) of a pass share one request's context (a ContextKV: an extent of a KV pool)."""

    start: int
    stop: int
    ctx: Any


class ContextRows:
    """The context part of a pass: every row over its group's pooled context.

    `groups` in any order; rows outside every group, and groups of no rows, take nothing from the context.
    Rows carry `per_row` query positions each. Contexts from one pool (the engine's) make one varlen call per
    layer; several pools, one call each, merged exactly. `fast`: the CUDA kernel (see `varlen_attention`).
    """

    def __init__(self, groups: list[ContextGroup], rows: int, per_row: int = 1, fast: bool = False):
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
        pools = list({id(c.pool): c.pool for c in ctxs if c is not None}.values()) or [None]
        cu_q = [c * per_row for c in cu]
        self.fast = fast
        self.parts = []
        for pool in pools:
            mine = [c if c is not None and c.pool is pool else None for c in ctxs]
            starts = [c.offset if c is not None else 0 for c in mine]
            self.parts.append((pool, Spans(cu_q, starts, [c.length if c is not None else 0 for c in mine])))

    def at_layer(self, i: int) -> LayerRows:
        return LayerRows(self, i)

    def attend(self, q: torch.Tensor, layer: int, scale: float):
        """q [rows * per_row, H, D] -> (out [.., H, D], lse [H, ..]) over each row's context."""
        out = lse = None
        for pool, spans in self.parts:
            if pool is None:  # no row has a context
                M, H, D = q.shape
                return q.new_zeros(M, H, D), torch.full((H, M), float("-inf"), device=q.device)
            o, s = varlen_attention(q, pool.k[layer], pool.v[layer], spans, scale, fast=self.fast)
            out, lse = (o, s) if out is None else (out + o, torch.logaddexp(lse, s))
        return out, lse


@dataclass(frozen=True)
class LayerRows:
    """One layer of `ContextRows`: what `shared_context_attention` reads."""

    rows: ContextRows
    layer: int

    def attend(self, q: torch.Tensor, scale: float):
        return self.rows.attend(q, self.layer, scale)
