"""A plain HSTU reference for equality tests, written apart from `genrec.model.hstu`.

The whole [history + candidates] sequence in one forward, one dense boolean mask, float64, no cache, each head
in turn; it reads the model's parameters by their checkpoint names and shares no code with the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from genrec.model.config import HSTUConfig


@dataclass
class ReferenceOutput:
    hidden: torch.Tensor  # [T + C, hidden] before the final norm: history rows, then candidate rows
    probs: torch.Tensor  # [C, tasks]


def ranking_mask(history: int, candidates: int) -> torch.Tensor:
    """[L, L] bool, True = may attend: history causal; a candidate sees the history and itself only."""
    size = history + candidates
    mask = torch.zeros(size, size, dtype=torch.bool)
    for i in range(size):
        if i < history:
            mask[i, : i + 1] = True
        else:
            mask[i, :history] = True
            mask[i, i] = True
    return mask


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


@torch.no_grad()
def reference_rank(
    params: dict[str, torch.Tensor],
    config: HSTUConfig,
    items: list[int],
    actions: list[int | None],
    candidates: list[int],
    buckets: list[int | None] | None = None,
    candidate_buckets: list[int | None] | None = None,
) -> ReferenceOutput:
    """History events (items, actions, buckets; None = no action / unknown bucket) then candidates (no action,
    position = history length)."""
    p = {name: t.detach().double().cpu() for name, t in params.items()}
    T, C = len(items), len(candidates)
    H, D, N, eps = config.num_attention_heads, config.head_dim, config.attention_normalizer, config.layer_norm_eps
    seq_items = list(items) + list(candidates)
    seq_actions = [config.num_actions if a is None else a for a in actions] + [config.num_actions] * C
    positions = list(range(T)) + [T] * C
    x = (
        p["item_embedding.weight"][seq_items]
        + p["action_embedding.weight"][seq_actions]
        + p["position_embedding.weight"][positions]
    )
    if config.num_time_buckets:
        hist = buckets if buckets is not None else [None] * T
        cand = candidate_buckets if candidate_buckets is not None else [None] * C
        seq_buckets = [config.num_time_buckets if b is None else b for b in list(hist) + list(cand)]
        x = x + p["bucket_embedding.weight"][seq_buckets]
    mask = ranking_mask(T, C).double()
    width = H * D
    for i in range(config.num_hidden_layers):
        pre = f"layers.{i}."
        normed = _layer_norm(x, p[pre + "norm.weight"], p[pre + "norm.bias"], eps)
        projected = _silu(normed @ p[pre + "uvqk.weight"].T + p[pre + "uvqk.bias"])
        u, v, q, k = (projected[:, j * width : (j + 1) * width] for j in range(4))
        heads = []
        for h in range(H):
            cols = slice(h * D, (h + 1) * D)
            weights = _silu(q[:, cols] @ k[:, cols].T / math.sqrt(D)) * mask / N
            heads.append(weights @ v[:, cols])
        attn = torch.cat(heads, dim=1)
        gated = u * _layer_norm(attn, p[pre + "attn_norm.weight"], p[pre + "attn_norm.bias"], eps)
        x = x + gated @ p[pre + "out.weight"].T + p[pre + "out.bias"]
    final = _layer_norm(x[T:], p["final_norm.weight"], p["final_norm.bias"], eps)
    hidden = _silu(final @ p["head.hidden.weight"].T + p["head.hidden.bias"])
    logits = hidden @ p["head.out.weight"].T + p["head.out.bias"]
    return ReferenceOutput(hidden=x, probs=1.0 / (1.0 + torch.exp(-logits)))
