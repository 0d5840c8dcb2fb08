"""The context part of many requests in one call: each sequence's queries over its own span of a token-major
pool (gaps allowed). `varlen_reference`: plain torch, any device; `flash_varlen`: FlashAttention-2 varlen (CUDA, half
precision; verified on an H200 against the reference). An execution plan picks one (genrec.attention.kernels)."""

from __future__ import annotations

import numpy as np
import torch

from genrec.staging import to_device


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


def varlen_reference(q, k, v, spans: Spans, scale: float, causal: bool = False, need_lse: bool = True):
    """q [M, H, D] packs the spans' sequences over k, v [T, KV, D] (one pool layer); causal is bottom-right (the
    last query sees every key, as chunked prefill needs). -> (out [M, H, D] in q's dtype, lse [H, M] f32 or None);
    no keys: 0 and -inf. Plain torch, one sequence at a time: the reference the CUDA kernel is checked against."""
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
    if m == n and q.device.type == "cpu" and (q.device.type, q.dtype) not in _FUSED_BROKEN:
        try:  # the fused kernel returns the log-sum-exp too (its causal mask is top-left: right only when m == n)
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q.transpose(0, 1)[None], kh[None], vh[None], 0.0, True, scale=scale
            )
            return out[0].transpose(0, 1), lse[0]
        except RuntimeError:
            _FUSED_BROKEN.add((q.device.type, q.dtype))
    s = torch.bmm(q.transpose(0, 1), kh.transpose(1, 2)).float() * scale
    visible = mask if mask is not None else torch.ones(m, n, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.bmm(torch.exp(s - lse[..., None]).to(vh.dtype), vh)
    return out.transpose(0, 1), lse


def flash_varlen(q, k, v, spans: Spans, scale: float, causal: bool = False, need_lse: bool = True):
    """`varlen_reference`'s contract in FlashAttention-2 varlen (torch's aten op; CUDA, half precision): keys of
    sequence b read at cu_seq_k[b] for seqused_k[b]; the lse is always computed."""
    cu_q, cu_k, used, max_q, max_k, empty = spans.device_args(q.device)
    out, lse = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, seqused_k=used
    )[:2]
    if empty is not None:
        out = out.masked_fill(empty[:, None, None], 0)
        lse = lse.masked_fill(empty[None], float("-inf"))
    return out, lse


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Unmasked q [KV, M, D] over k/v [KV, T, D] -> (out [KV, M, D], lse [KV, M] f32): torch's fused flash
    kernels where they apply (they return the lse the merge needs), else matmuls."""
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
