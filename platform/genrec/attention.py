"""Shared-context attention: the primitive behind beam decode and multi-candidate scoring.

R rows belong to requests. Each row attends to

    [ its request's context K/V (the prompt, stored once) ] + [ its own short suffix K/V (causal) ]

The context part is one matrix product per request for all of its rows, with the GQA groups and the
row's query positions folded into the query dimension, so the prompt is read once per request and
never copied per row. The two partial softmaxes are merged exactly through their running maxima
(log-sum-exp), which equals one softmax over the concatenated keys.

With pooled contexts (`ContextRows`), the context part of every request is ONE varlen call per layer:
every request's rows attend to its own span of the token-major pool (`varlen_attention`). On the CPU
that call is a plain-torch loop (the reference); on CUDA it can be FlashAttention-2 varlen, behind the
`CUDA_FAST` switch (env GENREC_CUDA_FAST=1), off until a GPU run has verified it against the reference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from genrec.staging import to_device

# FlashAttention-2 varlen (and the decode CUDA graphs) on CUDA. Off by default: not yet verified on a GPU.
CUDA_FAST = os.environ.get("GENREC_CUDA_FAST", "") == "1"


class LayeredContext(Protocol):
    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class LayerContext:
    """Rows [start, stop) attend to k, v: [kv_heads, T, head_dim]."""

    start: int
    stop: int
    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class ContextGroup:
    """Rows [start, stop) share one request's context (any object with `.layer(i) -> (k, v)`)."""

    start: int
    stop: int
    ctx: LayeredContext

    def at_layer(self, i: int) -> LayerContext:
        k, v = self.ctx.layer(i)
        return LayerContext(self.start, self.stop, k, v)


def shared_context_attention(
    q: torch.Tensor,
    groups: list[LayerContext] | LayerRows | StaticRows,
    suffix_k: torch.Tensor,
    suffix_v: torch.Tensor,
    suffix_mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Attention of R rows over their group's context plus their own suffix.

    q: [R, S, H, D] (S query positions per row); suffix_k/suffix_v: [R, U, KV, D];
    suffix_mask: [R or 1, S, U] bool (True = may attend) or None for "all visible". Every query position
    must see at least one suffix key. `groups`: one layer of pooled `ContextRows` (one varlen call), or a
    list of LayerContext (one call per group). Rows outside every group attend to their suffix only; a
    group of no rows is skipped (a zero-row query must never reach a fused kernel: the CPU one dies on it).
    Returns [R, S, H, D] in q's dtype.
    """
    R, S, H, D = q.shape
    KV = suffix_k.shape[2]
    G = H // KV
    qg = q.view(R, S, KV, G, D)

    # Suffix part, all rows at once: scores [R, KV, G, S, U].
    s_suf = torch.einsum("rskgd,rukd->rkgsu", qg, suffix_k).float() * scale
    if suffix_mask is not None:
        s_suf = s_suf.masked_fill(~suffix_mask[:, None, None], float("-inf"))
    lse_suf = torch.logsumexp(s_suf, dim=-1)  # [R, KV, G, S]
    p_suf = torch.exp(s_suf - lse_suf[..., None])
    out_suf = torch.einsum("rkgsu,rukd->rkgsd", p_suf.to(suffix_v.dtype), suffix_v).float()

    if hasattr(groups, "attend"):  # pooled rows: one varlen call
        out, lse = groups.attend(q.reshape(R * S, H, D), scale)  # [R*S, H, D], [H, R*S]
        out_ctx = out.view(R, S, KV, G, D).permute(0, 2, 3, 1, 4).float()
        lse_ctx = lse.view(KV, G, R, S).permute(2, 0, 1, 3)
    else:
        out_ctx, lse_ctx = _per_group_context(qg, groups, scale)

    # Exact merge of the two partial softmaxes.
    lse = torch.logaddexp(lse_ctx, lse_suf)
    out = out_ctx * torch.exp(lse_ctx - lse)[..., None] + out_suf * torch.exp(lse_suf - lse)[..., None]
    return out.permute(0, 3, 1, 2, 4).reshape(R, S, H, D).to(q.dtype)


def _per_group_context(qg: torch.Tensor, groups: list[LayerContext], scale: float):
    """Context part, one product per group: its rows, GQA groups and positions form the query axis.
    Returns (out [R, KV, G, S, D] float32, lse [R, KV, G, S])."""
    R, S, KV, G, D = qg.shape
    q_all = qg.permute(2, 0, 3, 1, 4).reshape(KV, R * G * S, D)  # built once; each group's rows are a slice
    width = G * S
    outs, lses, row = [], [], 0

    def nothing(rows: int) -> None:  # rows without a context take nothing from this part
        outs.append(q_all.new_zeros(KV, rows * width, D))
        lses.append(torch.full((KV, rows * width), float("-inf"), device=qg.device))

    for g in sorted((g for g in groups if g.stop > g.start), key=lambda g: g.start):
        if g.start > row:
            nothing(g.start - row)
        if g.k.shape[1] == 0:
            nothing(g.stop - g.start)
        else:
            out, lse = context_attention(q_all[:, g.start * width : g.stop * width], g.k, g.v, scale)
            outs.append(out)
            lses.append(lse)
        row = g.stop
    if row < R:
        nothing(R - row)
    out_ctx = torch.cat(outs, dim=1).view(KV, R, G, S, D).permute(1, 0, 2, 3, 4).float()
    lse_ctx = torch.cat(lses, dim=1).float().view(KV, R, G, S).permute(1, 0, 2, 3)
    return out_ctx, lse_ctx


# -- varlen: many requests' rows, each over its own span of one token-major pool, in one call --------------


class Spans:
    """n sequences packed along the query axis: sequence b's queries are cu_q[b]:cu_q[b+1], its keys the pool
    tokens k_start[b] : k_start[b] + k_len[b]. Host lists; the device copies are made once, when first needed."""

    def __init__(self, cu_q: list[int], k_start: list[int], k_len: list[int]):
        self.cu_q, self.k_start, self.k_len = cu_q, k_start, k_len
        self._device = None

    def device_args(self, device):
        """(cu_seq_q, cu_seq_k, seqused_k) int32 on the device, max_q, max_k, and the queries of sequences
        with no keys (bool [M], or None): FA2 gives those +inf LSE, so they are masked afterwards."""
        if self._device is None:
            cu_q = np.asarray(self.cu_q)
            k_len = np.asarray(self.k_len)
            empty = np.repeat(k_len == 0, np.diff(cu_q))
            self._device = (
                to_device(cu_q, device, torch.int32),
                to_device(self.k_start + [0], device, torch.int32),
                to_device(k_len, device, torch.int32),
                int(np.diff(cu_q).max(initial=0)),
                int(k_len.max(initial=0)),
                to_device(empty, device, torch.bool) if empty.any() else None,
            )
        return self._device


def varlen_attention(q, k, v, spans: Spans, scale: float, causal: bool = False, need_lse: bool = True):
    """q [M, H, D] packs the spans' sequences; k, v [T, KV, D] are one layer of a token-major pool.

    Sequence b's queries attend to its key span (causal: aligned bottom-right, the last query sees every key,
    as chunked prefill needs). Returns (out [M, H, D] in q's dtype, lse [H, M] float32, or None when not
    `need_lse`); a sequence without keys gets out 0 and lse -inf. On CUDA with CUDA_FAST, bf16/fp16: one
    FlashAttention-2 varlen call; otherwise `varlen_reference`.
    """
    if CUDA_FAST and q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        return _flash_varlen(q, k, v, spans, scale, causal)
    return varlen_reference(q, k, v, spans, scale, causal, need_lse)


def varlen_reference(q, k, v, spans: Spans, scale: float, causal: bool = False, need_lse: bool = True):
    """Plain torch, one sequence at a time: the reference the CUDA kernel is checked against."""
    M, H, D = q.shape
    KV = k.shape[1]
    G = H // KV
    outs, lses = [], []
    for b in range(len(spans.k_len)):
        lo, hi, start, n = spans.cu_q[b], spans.cu_q[b + 1], spans.k_start[b], spans.k_len[b]
        if hi == lo:
            continue  # a sequence of no queries never reaches a kernel
        keys, values = k[start : start + n].transpose(0, 1), v[start : start + n].transpose(0, 1)  # [KV, n, D]
        if n == 0:
            outs.append(q.new_zeros(hi - lo, H, D))
            lses.append(torch.full((H, hi - lo), float("-inf"), device=q.device))
        elif causal:
            out, lse = _causal(q[lo:hi], keys, values, scale, need_lse)
            outs.append(out)
            lses.append(lse)
        else:  # queries and GQA groups folded into one query axis per KV head: [KV, rows * G, D]
            qb = q[lo:hi].view(hi - lo, KV, G, D).permute(1, 0, 2, 3).reshape(KV, (hi - lo) * G, D)
            out, lse = context_attention(qb, keys, values, scale)
            outs.append(out.view(KV, hi - lo, G, D).permute(1, 0, 2, 3).reshape(hi - lo, H, D))
            lses.append(lse.view(KV, hi - lo, G).permute(0, 2, 1).reshape(H, hi - lo))
    out = outs[0] if len(outs) == 1 else torch.cat(outs) if outs else q.new_zeros(0, H, D)
    if not need_lse:
        return out, None
    lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=1) if lses else q.new_zeros(H, 0, dtype=torch.float32)
    return out, lse.float()


def _causal(q, keys, values, scale, need_lse):
    """Bottom-right causal attention of q [m, H, D] over keys [KV, n, D] (the last query sees all n)."""
    m, n = q.shape[0], keys.shape[1]
    mask = None
    if m != n:
        mask = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - m, n, device=q.device)[:, None]
    if not need_lse:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys[None],
            values[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1), None
    H, KV = q.shape[1], keys.shape[0]
    kh, vh = keys.repeat_interleave(H // KV, 0), values.repeat_interleave(H // KV, 0)  # [H, n, D]
    s = torch.bmm(q.transpose(0, 1), kh.transpose(1, 2)).float() * scale
    visible = mask if mask is not None else torch.ones(m, n, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.bmm(torch.exp(s - lse[..., None]).to(vh.dtype), vh)
    return out.transpose(0, 1), lse


def _flash_varlen(q, k, v, spans: Spans, scale: float, causal: bool):
    """FlashAttention-2 varlen (torch's aten op): keys of sequence b read at cu_seq_k[b] for seqused_k[b]."""
    cu_q, cu_k, used, max_q, max_k, empty = spans.device_args(q.device)
    out, lse = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, seqused_k=used
    )[:2]
    if empty is not None:
        out = out.masked_fill(empty[:, None, None], 0)
        lse = lse.masked_fill(empty[None], float("-inf"))
    return out, lse


@dataclass(frozen=True)
class LayerRows:
    """One layer of `ContextRows`: what `shared_context_attention` reads instead of a list of groups."""

    rows: ContextRows
    layer: int

    def attend(self, q: torch.Tensor, scale: float):
        return self.rows.attend(q, self.layer, scale)


class ContextRows:
    """Which rows of a pass attend to which pooled context, worked out once for all layers.

    `groups` (ContextGroup, ctx a ContextKV) in any order; rows outside every group, and groups of no rows,
    take nothing from the context. Rows carry `per_row` query positions each. Contexts from one pool (the
    engine's) make one varlen call per layer; several pools, one call each, merged exactly.
    """

    def __init__(self, groups: list[ContextGroup], rows: int, per_row: int = 1):
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
            o, s = varlen_attention(q, pool.k[layer], pool.v[layer], spans, scale)
            out, lse = (o, s) if out is None else (out + o, torch.logaddexp(lse, s))
        return out, lse


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Softmax attention without a mask: q [KV, M, D] over k/v [KV, T, D].

    Returns (out [KV, M, D] in q's dtype, log-sum-exp of the scores [KV, M] float32). Uses PyTorch's
    fused flash kernels where they apply (they return the log-sum-exp we need for the merge), else matmuls.
    """
    fused = _fused_kernel(q) if q.shape[1] else None  # no queries: never a fused kernel (SIGFPE on CPU)
    if fused is not None:
        try:
            out, lse = fused(q[None], k[None], v[None], scale)
            return out[0], lse[0, :, : q.shape[1]]
        except RuntimeError:
            _FUSED_BROKEN.add((q.device.type, q.dtype))
    return math_context_attention(q, k, v, scale)


def math_context_attention(q, k, v, scale):
    s = torch.bmm(q, k.transpose(1, 2)).float() * scale
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    return torch.bmm(p.to(v.dtype), v), lse


_FUSED_BROKEN: set = set()


def _cpu_flash(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
    return out, lse


def _cuda_flash(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
    return out, lse


def _cuda_efficient(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False, scale=scale)[:2]
    return out, lse


def _fused_kernel(q: torch.Tensor):
    if (q.device.type, q.dtype) in _FUSED_BROKEN:
        return None
    if q.device.type == "cpu":
        return _cpu_flash
    if q.device.type == "cuda":
        return _cuda_flash if q.dtype in (torch.float16, torch.bfloat16) else _cuda_efficient
    return None


# -- the same call with static shapes, for the decode pass a CUDA graph replays --------------------------------


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """`varlen_attention` as one operator over index tensors of fixed size (sequence b: queries
    cu_q[b]:cu_q[b+1], keys cu_k[b] for used_k[b]; row_empty [M]: rows of sequences without keys), so a
    decode pass has the same op shapes whatever its request mix. This implementation (CPU, or CUDA with
    the switch off) reads the index tensors on the host and runs the reference."""
    spans = Spans(cu_q.tolist(), cu_k[:-1].tolist(), used_k.tolist())
    out, lse = varlen_reference(q, k, v, spans, scale)
    return out.clone(), lse.clone()


@varlen_op.register_kernel("cuda")
def _varlen_op_cuda(q, k, v, cu_q, cu_k, used_k, row_empty, max_q, max_k, scale):
    if not (CUDA_FAST and q.dtype in (torch.float16, torch.bfloat16)):
        spans = Spans(cu_q.tolist(), cu_k[:-1].tolist(), used_k.tolist())  # syncs: the eager path only
        out, lse = varlen_reference(q, k, v, spans, scale)
        return out.clone(), lse.clone()
    out, lse = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False, scale=scale, seqused_k=used_k
    )[:2]
    return out.masked_fill(row_empty[:, None, None], 0), lse.masked_fill(row_empty[None], float("-inf"))


@dataclass(frozen=True)
class StaticRows:
    """One layer's context part from fixed-size index buffers (see `genrec.engine.decode_graph`)."""

    k: torch.Tensor  # [T, KV, D] a pool layer
    v: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    used_k: torch.Tensor
    row_empty: torch.Tensor
    max_k: int

    def attend(self, q: torch.Tensor, scale: float):
        args = (self.cu_q, self.cu_k, self.used_k, self.row_empty)
        return varlen_op(q, self.k, self.v, *args, q.shape[0], self.max_k, scale)
