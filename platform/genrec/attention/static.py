"""The context call with static shapes, for the decode pass a CUDA graph replays.

The request mix, widths and context lengths are data in fixed-size index tensors, never shapes, so a decode
pass has the same op shapes whatever its mix (see `genrec.engine.decode_batch`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from genrec.attention.merge import merge_spans
from genrec.attention.varlen import Spans, varlen_reference


@torch.library.custom_op("genrec::varlen_attention", mutates_args=())
def varlen_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    used_k: torch.Tensor,
    row_empty: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    fast: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`varlen_attention` over fixed-size index tensors (sequence b: queries cu_q[b]:cu_q[b+1], keys cu_k[b] for
    used_k[b]; row_empty [M]: rows without keys). Here (CPU, or CUDA without `fast`): the reference, synced."""
    spans = Spans(cu_q.tolist(), cu_k[:-1].tolist(), used_k.tolist())
    out, lse = varlen_reference(q, k, v, spans, scale)
    return out.clone(), lse.clone()


@varlen_op.register_kernel("cuda")
def _varlen_op_cuda(q, k, v, cu_q, cu_k, used_k, row_empty, max_q, max_k, scale, fast):
    if not (fast and q.dtype in (torch.float16, torch.bfloat16)):
        spans = Spans(cu_q.tolist(), cu_k[:-1].tolist(), used_k.tolist())  # syncs: the eager path only
        out, lse = varlen_reference(q, k, v, spans, scale)
        return out.clone(), lse.clone()
    out, lse = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False, scale=scale, seqused_k=used_k
    )[:2]
    return out.masked_fill(row_empty[:, None, None], 0), lse.masked_fill(row_empty[None], float("-inf"))


@dataclass(frozen=True)
class StaticContext:
    """The context part of a decode pass: ONE varlen call per layer, whatever the spans. Several spans: the rows
    repeat once per span (span-major blocks; block j: each request's rows over its span j, empty if it has fewer),
    merged by `merge_spans`; one span: no repeat, no merge. Fixed sizes: cu_q, cu_k [spans * (rows + 1) + 1]
    (offsets into the repeated rows / the pool), used_k [spans * (rows + 1)], row_empty [spans * rows]."""

    pool: object  # a KVPool
    rows: int
    spans: int
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    used_k: torch.Tensor
    row_empty: torch.Tensor
    fast: bool = False
    merge: Callable = merge_spans  # or it compiled (genrec.model.fused: the pass's pieces)

    def at_layer(self, i: int) -> StaticRows:
        return StaticRows(self, i)


@dataclass(frozen=True)
class StaticRows:
    """One layer of a `StaticContext`."""

    context: StaticContext
    layer: int

    def attend(self, q: torch.Tensor, scale: float):
        c = self.context
        k, v = c.pool.k[self.layer], c.pool.v[self.layer]
        queries = q if c.spans == 1 else q.repeat(c.spans, 1, 1)
        args = (c.cu_q, c.cu_k, c.used_k, c.row_empty, queries.shape[0], c.pool.tokens, scale, c.fast)
        out, lse = varlen_op(queries, k, v, *args)
        return (out, lse) if c.spans == 1 else c.merge(out, lse, c.spans)
