"""Shared-context attention: the primitive behind beam decode and multi-candidate scoring.

R rows belong to requests. Each row attends to

    [ its request's context K/V (the prompt, stored once) ] + [ its own short suffix K/V (causal) ]

The context part is one matrix product per request for all of its rows, with the GQA groups and the
row's query positions folded into the query dimension, so the prompt is read once per request and
never copied per row. The two partial softmaxes are merged exactly through their running maxima
(log-sum-exp), which equals one softmax over the concatenated keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


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
    groups: list[LayerContext],
    suffix_k: torch.Tensor,
    suffix_v: torch.Tensor,
    suffix_mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Attention of R rows over their group's context plus their own suffix.

    q: [R, S, H, D] (S query positions per row); suffix_k/suffix_v: [R, U, KV, D];
    suffix_mask: [R or 1, S, U] bool (True = may attend) or None for "all visible". Every query position
    must see at least one suffix key. Rows outside every group attend to their suffix only; a group of
    no rows is skipped (a zero-row query must never reach a fused kernel: the CPU one dies on it).
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

    # Context part, one product per request: its rows, GQA groups and positions form the query axis.
    # The query layout [KV, rows * G * S, D] is built once; each request's rows are a slice of it.
    q_all = qg.permute(2, 0, 3, 1, 4).reshape(KV, R * G * S, D)
    width = G * S
    outs, lses, row = [], [], 0

    def nothing(rows: int) -> None:  # rows without a context take nothing from this part
        outs.append(q_all.new_zeros(KV, rows * width, D))
        lses.append(torch.full((KV, rows * width), float("-inf"), device=q.device))

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

    # Exact merge of the two partial softmaxes.
    lse = torch.logaddexp(lse_ctx, lse_suf)
    out = out_ctx * torch.exp(lse_ctx - lse)[..., None] + out_suf * torch.exp(lse_suf - lse)[..., None]
    return out.permute(0, 3, 1, 2, 4).reshape(R, S, H, D).to(q.dtype)


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
