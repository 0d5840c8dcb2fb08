"""The served HSTU's ranking math as one dense, differentiable pass over padded rows (for training).

Same modules and the same masks as `HSTU.prefill` + `forward_candidates`: history events attend causally among
themselves, each candidate attends to the whole history and to itself; history never attends to candidates.
Padded history slots are masked out as keys (SiLU scores times 0), so they add exactly nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from genrec.model.hstu import HSTU
from genrec_demo.ranker.events import RankBatch


def rank_logits(model: HSTU, batch: RankBatch, dropout: float = 0.0) -> torch.Tensor:
    """[B, C, tasks] logits of each row's candidates after its history."""
    return model.task_logits(hidden_states(model, batch, dropout)[1])


def hidden_states(model: HSTU, batch: RankBatch, dropout: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The last layer's outputs (before the final norm): history [B, W, hidden], candidates [B, C, hidden]."""
    b, w = batch.items.shape
    c = batch.candidates.shape[1]
    x = _embed(model, batch.items, batch.actions, torch.arange(w).expand(b, w), batch.buckets)
    y = _embed(model, batch.candidates, None, batch.lengths[:, None].expand(b, c), None)
    x, y = F.dropout(x, dropout, model.training), F.dropout(y, dropout, model.training)
    valid = torch.arange(w)[None, :] < batch.lengths[:, None]  # [B, W]
    keys = valid[:, None, None, :]  # [B, 1 (heads), 1 (queries), W]
    causal = torch.ones(w, w, dtype=torch.bool).tril() & keys
    for layer in model.layers:
        u, v, q, k = (t.transpose(1, 2) for t in layer.project(x))  # [B, H, W, D]
        uc, vc, qc, kc = layer.project(y)  # [B, C, H, D]
        history = _attend(model, q, k, v, causal)
        over_history = _attend(model, qc.transpose(1, 2), k, v, keys)
        own = F.silu((qc * kc).sum(-1, keepdim=True) * model.scale) * vc
        x = layer.finish(x, u.transpose(1, 2), history.transpose(1, 2) * model.inv_normalizer)
        y = layer.finish(y, uc, (over_history.transpose(1, 2) + own) * model.inv_normalizer)
    return x, y


def _embed(model: HSTU, items, actions, positions, buckets) -> torch.Tensor:
    shape = items.shape
    flat = [None if t is None else t.reshape(-1) for t in (items, actions, positions, buckets)]
    return model.embed_events(*flat).view(*shape, -1)


def _attend(model: HSTU, q, k, v, mask) -> torch.Tensor:
    """Σ_j mask · SiLU(q·k_j/√d) v_j over [B, H, ·, D] tensors (not divided by N)."""
    return (F.silu(q @ k.transpose(-1, -2) * model.scale) * mask) @ v
