"""Prefill kernels beside FlashAttention-2, for the plan to choose by measurement (genrec.attention.choice): each
keeps `varlen_reference`'s contract, so any of them can stand in for FlashAttention-2's varlen call.

- cuDNN attention (torch's SDPBackend.CUDNN_ATTENTION; no new wheel). It has no per-sequence key count for spans
  of a pool, so it takes only the plain causal calls whose every sequence reads exactly its own queries' keys (a
  prompt's own tokens, no log-sum-exp): one dense call per sequence. Every other call goes to FlashAttention-2.
- FlashAttention-3 (`flash_attn_interface`, Hopper), where it is installed: every varlen call.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from genrec.attention.varlen import Spans, flash_varlen


def dense_causal_varlen(q, k, v, spans: Spans, scale: float, causal=False, need_lse=True, *, dense, fallback):
    """`dense(q [m, H, D], keys [m, KV, D], values, scale) -> out [m, H, D]` (causal) per sequence when the call is
    plain causal and each sequence's keys are its own queries' (or it has none: zeros); else `fallback`'s call."""
    if not causal or need_lse or not reads_own_tokens(spans):
        return fallback(q, k, v, spans, scale, causal, need_lse)
    out = torch.zeros_like(q)
    for b, (start, n) in enumerate(zip(spans.k_start, spans.k_len, strict=True)):
        if n:  # a sequence without keys (its chunk is another call's) keeps its zeros
            lo = spans.cu_q[b]
            out[lo : lo + n] = dense(q[lo : lo + n], k[start : start + n], v[start : start + n], scale)
    return out, None


def reads_own_tokens(spans: Spans) -> bool:
    """Every sequence has as many keys as queries (or no keys): top-left and bottom-right causal agree."""
    queries = [hi - lo for lo, hi in zip(spans.cu_q, spans.cu_q[1:], strict=False)]
    return all(n in (0, m) for m, n in zip(queries, spans.k_len, strict=True))


def sdpa_causal(q, keys, values, scale, backends=None):
    """One sequence's causal attention by torch's SDPA (restricted to `backends` when given); K/V heads repeated
    to the query heads (grouped-query attention), since not every backend takes them grouped."""
    groups = q.shape[1] // keys.shape[1]
    k, v = (x.transpose(0, 1).repeat_interleave(groups, 0)[None] for x in (keys, values))
    with sdpa_kernel(backends) if backends is not None else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True, scale=scale)
    return out[0].transpose(0, 1)


def cudnn_available(device: torch.device) -> bool:
    return device.type == "cuda" and hasattr(SDPBackend, "CUDNN_ATTENTION")


cudnn_varlen = functools.partial(
    dense_causal_varlen,
    dense=functools.partial(sdpa_causal, backends=[SDPBackend.CUDNN_ATTENTION])
    if hasattr(SDPBackend, "CUDNN_ATTENTION")
    else None,
    fallback=flash_varlen,
)


def flash3_available(device: torch.device) -> bool:
    """FlashAttention-3 runs on Hopper (compute capability 9.x) where its package is installed."""
    return (
        device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] == 9
        and importlib.util.find_spec("flash_attn_interface") is not None
    )


def flash3_varlen(q, k, v, spans: Spans, scale: float, causal: bool = False, need_lse: bool = True):
    """`varlen_reference`'s contract in FlashAttention-3's varlen call (keys of sequence b at cu_seqlens_k[b], for
    seqused_k[b]; causal bottom-right, as FlashAttention-2's)."""
    from flash_attn_interface import flash_attn_varlen_func

    cu_q, cu_k, used, max_q, max_k, empty = spans.device_args(q.device)
    result = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, seqused_k=used, softmax_scale=scale, causal=causal, return_attn_probs=True
    )
    out, lse = result[0], result[1]
    if empty is not None:
        out = out.masked_fill(empty[:, None, None], 0)
        lse = lse.masked_fill(empty[None], float("-inf"))
    return out, lse.float()
