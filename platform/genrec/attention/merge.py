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
    past: tuple | None = None,
) -> torch.Tensor:
    """R rows over their context plus their own suffix, merged exactly -> [R, S, H, D] in q's dtype.

    q [R, S, H, D]; suffix_k/v [R, U, KV, D]: each row's own keys after `past`'s (the keys before them, read where
    they lie: (k, v [T, KV, D], at [R, P]); None: no past); suffix_mask [R or 1, S, P + U] bool (True = may attend)
    or None (all visible); every query must see one suffix key. `merge`: `suffix_merge`, or it compiled
    (genrec.model.fused)."""
    R, S, H, D = q.shape
    out, lse = context.attend(q.reshape(R * S, H, D), scale)  # [R*S, H, D], [H, R*S]
    past_k, past_v, past_at = past or (None, None, None)
    return (merge or suffix_merge)(q, suffix_k, suffix_v, past_k, past_v, past_at, suffix_mask, out, lse, scale)


def suffix_merge(q, k, v, past_k, past_v, past_at, mask, out_ctx, lse_ctx, scale: float) -> torch.Tensor:
    """Everything after the context call: the suffix part, merged with out_ctx [R*S, H, D], lse_ctx [H, R*S] f32.
    The suffix is the past keys gathered where they lie (past_k/v [T, KV, D] at past_at [R, P]; no concatenation
    with the new ones: each part is weighed on its own) and the rows' own k/v [R, U, KV, D]."""
    R, S, H, D = q.shape
    KV = k.shape[2]
    qg = q.view(R, S, KV, H // KV, D).float() * scale
    parts = [(k, v, False)] if past_at is None else [(past_k[past_at], past_v[past_at], True), (k, v, False)]
    scores, values, start = [], [], 0
    for keys, vals, gathered in parts:
        s = _suffix_scores(qg, keys)  # [R, KV, G, S, U]
        if mask is not None:
            seen = mask[..., start : start + keys.shape[1]]  # [R or 1, S, U]
            s = torch.where(seen[:, None, None], s, float("-inf"))
            if gathered:  # hidden keys may be padding read from anywhere in the pool (another request's NaN, say):
                vals = torch.where(seen.any(dim=1)[:, :, None, None], vals, 0)  # weight 0, but 0 * NaN is NaN
        scores.append(s)
        values.append(vals)
        start += keys.shape[1]
    lse_ctx = lse_ctx.view(KV, H // KV, R, S).permute(2, 0, 1, 3)  # [R, KV, G, S]
    lse = lse_ctx  # the log of every part's sum of exp(score): each part's share is exp(its lse - lse)
    for s in scores:
        lse = torch.logaddexp(lse, torch.logsumexp(s, dim=-1))
    out = out_ctx.view(R, S, KV, H // KV, D).permute(0, 2, 3, 1, 4).float() * torch.exp(lse_ctx - lse)[..., None]
    for s, vals in zip(scores, values, strict=True):
        out = out + _weighted(torch.exp(s - lse[..., None]), vals)
    return out.permute(0, 3, 1, 2, 4).reshape(R, S, H, D).to(q.dtype)


def _suffix_scores(qg: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """qg [R, S, KV, G, D] f32 against each row's keys [R, U, KV, D] -> [R, KV, G, S, U] f32 (float32 operands, as
    the context part's kernel keeps its scores: a bf16 product would round each score before the softmax). A decode
    row (S == 1) over its few keys as products and a sum (compiled: elementwise, no matrix-product kernel)."""
    keys = keys.float()
    if qg.shape[1] == 1:
        return (qg.permute(0, 2, 3, 1, 4)[..., None, :] * keys.permute(0, 2, 1, 3)[:, :, None, None]).sum(-1)
    return torch.einsum("rskgd,rukd->rkgsu", qg, keys)


def _weighted(p: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """Weights p [R, KV, G, S, U] of values [R, U, KV, D] -> [R, KV, G, S, D] f32 (S == 1: products and a sum)."""
    vals = vals.float()
    if p.shape[3] == 1:
        return (p[..., None] * vals.permute(0, 2, 1, 3)[:, :, None, None]).sum(-2)
    return torch.einsum("rkgsu,rukd->rkgsd", p, vals)


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
