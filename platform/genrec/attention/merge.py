"""The suffix part of shared-context attention, and its exact merge with the context part."""

from __future__ import annotations

from typing import Protocol

import torch


class ContextLayer(Protocol):
    """One layer's context part: (out [M, H, D], lse [H, M] f32); a row without a context gets 0 and -inf."""

    def attend(self, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]: ...


def shared_context_attention(
    q: torch.Tensor,
    context: ContextLayer,
    suffix_k: torch.Tensor,
    suffix_v: torch.Tensor,
    suffix_mask: torch.Tensor | None,
    scale: float,
    merge=None,
) -> torch.Tensor:
    """R rows over their context plus their own suffix, merged exactly -> [R, S, H, D] in q's dtype.

    q [R, S, H, D]; suffix_k/v [R, U, KV, D]; suffix_mask [R or 1, S, U] bool (True = may attend) or None (all
    visible); every query must see one suffix key. `merge`: `suffix_merge`, or it compiled (genrec.model.fused)."""
    R, S, H, D = q.shape
    out, lse = context.attend(q.reshape(R * S, H, D), scale)  # [R*S, H, D], [H, R*S]
    return (merge or suffix_merge)(q, suffix_k, suffix_v, suffix_mask, out, lse, scale)


def suffix_merge(q, suffix_k, suffix_v, suffix_mask, out_ctx, lse_ctx, scale: float) -> torch.Tensor:
    """Everything after the context call: the suffix part, merged with out_ctx [R*S, H, D], lse_ctx [H, R*S] f32."""
    R, S, H, D = q.shape
    KV = suffix_k.shape[2]
    G = H // KV
    qg = q.view(R, S, KV, G, D)

    # Suffix part, all rows at once: scores [R, KV, G, S, U], in float32 as the context part's kernel keeps them (a
    # product in bf16 would round each score before the softmax).
    s_suf = torch.einsum("rskgd,rukd->rkgsu", qg.float(), suffix_k.float()) * scale
    if suffix_mask is not None:
        s_suf = torch.where(suffix_mask[:, None, None], s_suf, float("-inf"))
        # Hidden keys may be padding gathered from anywhere in the pool (another request's NaN, say): their
        # weight is 0, but 0 * NaN is NaN, so their values are zeroed too.
        suffix_v = torch.where(suffix_mask.any(dim=1)[:, :, None, None], suffix_v, 0)
    lse_suf = torch.logsumexp(s_suf, dim=-1)  # [R, KV, G, S]
    p_suf = torch.softmax(s_suf, dim=-1)
    out_suf = torch.einsum("rkgsu,rukd->rkgsd", p_suf.to(suffix_v.dtype), suffix_v).float()

    out_ctx = out_ctx.view(R, S, KV, G, D).permute(0, 2, 3, 1, 4).float()
    lse_ctx = lse_ctx.view(KV, G, R, S).permute(2, 0, 1, 3)
    # The context part's share, exp(lse_ctx) / (exp(lse_ctx) + exp(lse_suf)): 0 for a row without a context.
    share = torch.sigmoid(lse_ctx - lse_suf)[..., None]
    out = torch.lerp(out_suf, out_ctx, share)
    return out.permute(0, 3, 1, 2, 4).reshape(R, S, H, D).to(q.dtype)


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Two partial attentions of the same queries over disjoint keys as one (out [M, H, D], lse [H, M])."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).nan_to_num(0.0).T[..., None]  # -inf - -inf: neither side has keys
    weight_b = torch.exp(lse_b - lse).nan_to_num(0.0).T[..., None]
    out = out_a.float() * weight_a + out_b.float() * weight_b
    return out.to(out_a.dtype), lse


def merge_spans(out: torch.Tensor, lse: torch.Tensor, spans: int):
    """M queries over `spans` disjoint key sets, span-major (out [spans * M, H, D], lse [H, spans * M]), merged
    exactly into (out [M, H, D], lse [H, M]) in fixed kernels; a row with no keys at all gets 0 and -inf."""
    H = lse.shape[0]
    lse = lse.view(H, spans, -1)
    top = lse.amax(dim=1, keepdim=True)
    top = top.masked_fill(top == float("-inf"), 0.0)  # no keys in any span: weights exp(-inf) = 0, not NaN
    weight = torch.exp(lse - top)  # [H, spans, M]
    total = weight.sum(dim=1)  # [H, M]
    merged = torch.einsum("smhd,hsm->mhd", out.view(spans, -1, *out.shape[1:]).float(), weight)
    merged = merged / total.clamp_min(torch.finfo(total.dtype).tiny).T[..., None]
    return merged.to(out.dtype), torch.log(total) + top[:, 0]
