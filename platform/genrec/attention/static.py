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

FLASH_QUERY_BLOCK = 128  # query rows per FlashAttention-2 thread block (head dim 128, sm80 and later)
FLASH_MAX_SEQUENCES = 65_535  # its grid's y axis holds one block per sequence: CUDA's limit for grid.y


@torch.library.custom_op("genrec::static_varlen", mutates_args=())
def static_reference(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """`varlen_reference` over fixed-size index tensors (sequence b: queries cu_q[b]:cu_q[b+1], keys cu_k[b] for
    used_k[b]; row_empty [M]: rows without keys), synced: the reference plan's static call, on any device."""
    return _reference(q, k, v, cu_q, cu_k, used_k, scale)


@torch.library.custom_op("genrec::static_flash", mutates_args=())
def static_flash(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2's static call. Here (the CPU) its contract emulated over the reference, so the CUDA plan's
    Python runs and is judged on the CPU: a grid CUDA cannot launch fails, and the rows its grid does not reach
    (past ceil(max_q / 128) query blocks of their sequence, or in no sequence) are NaN unless `row_empty` masks them,
    as on CUDA, where they hold whatever the memory held."""
    sequences = cu_q.numel() - 1
    if sequences > FLASH_MAX_SEQUENCES:
        raise RuntimeError(f"CUDA error: invalid configuration argument (grid.y: {sequences} sequences > 65,535)")
    out, lse = _reference(q, k, v, cu_q, cu_k, used_k, scale)
    rows = torch.arange(q.shape[0])
    sequence = torch.searchsorted(cu_q.long(), rows, right=True) - 1
    reach = -(-max_q // FLASH_QUERY_BLOCK) * FLASH_QUERY_BLOCK
    reached = (rows < cu_q[-1]) & (rows - cu_q.long()[sequence.clamp_max(sequences - 1)] < reach)
    out = out.masked_fill(~reached[:, None, None], float("nan"))
    lse = lse.masked_fill(~reached[None], float("nan"))
    return out.masked_fill(row_empty[:, None, None], 0), lse.masked_fill(row_empty[None], float("-inf"))


@static_flash.register_kernel("cuda")
def _static_flash_cuda(q, k, v, cu_q, cu_k, used_k, row_empty, max_q, max_k, scale):
    out, lse = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False, scale=scale, seqused_k=used_k
    )[:2]
    return out.masked_fill(row_empty[:, None, None], 0), lse.masked_fill(row_empty[None], float("-inf"))


def _reference(q, k, v, cu_q, cu_k, used_k, scale):
    spans = Spans(cu_q.tolist(), cu_k[:-1].tolist(), used_k.tolist())
    out, lse = varlen_reference(q, k, v, spans, scale)
    return out.clone(), lse.clone()


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
    kernels: object  # genrec.attention.kernels.AttentionKernels: the plan's
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
        max_q = c.kernels.static_max_q(queries.shape[0])
        args = (c.cu_q, c.cu_k, c.used_k, c.row_empty, max_q, c.pool.tokens, scale)
        out, lse = c.kernels.static(queries, k, v, *args)
        return (out, lse) if c.spans == 1 else c.merge(out, lse, c.spans)
