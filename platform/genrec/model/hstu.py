"""Our HSTU ranker, the variant whose history K/V cache exactly (docs/engine.md, 'Ranking after a history: HSTU').

Each layer: LayerNorm -> one Linear to u, v, q, k (SiLU on each) -> `A = SiLU(q·kᵀ/√d) / N` (no softmax) ->
`Linear(u ⊙ LayerNorm(A·v))` -> residual; no FFN. A final LayerNorm and a multi-task MLP head read the candidates.
History attends causally, a candidate to the history and itself only: the history's K/V (cached after the SiLU,
token-major in the `KVPool`) depend on earlier events only, so it prefills in any number of appended chunks, and a
candidate's attention is its history part plus its own part. Items, actions, buckets, positions: genrec.model.config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save
from torch import nn

from genrec.files import write_atomically
from genrec.model import fused
from genrec.model.config import HSTUConfig
from genrec.model.fused import Pieces
from genrec.model.ops import PLAIN_OPS, ModelOps
from genrec.model.weights import Layout, assign_weights, loaded_embedding

# Prefill queries per attention call: bounds the [heads, chunk, keys] score matrix (1024 × 16k keys × 4 heads
# in float32 is 256 MiB) without changing any result.
PREFILL_QUERY_CHUNK = 1024


@dataclass(frozen=True)
class KeySpan:
    """Part of a history's K/V held elsewhere (a reused prefix piece): k, v [layers, T, heads, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class HistorySegment:
    """New history events `embeds` [n, hidden] following `start` events already in k_cache/v_cache
    [layers, capacity, heads, head_dim], which in turn follow the `prefix` spans (earlier events, read in place)."""

    embeds: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    start: int
    prefix: tuple[KeySpan, ...] = ()


@dataclass(frozen=True)
class HistoryRows:
    """Candidate rows [start, stop) of one request attend to its history: the `prefix` spans, then k, v
    [layers, T, heads, head_dim] (e.g. `ctx.k[:, :ctx.length]`; T may be 0)."""

    start: int
    stop: int
    k: torch.Tensor
    v: torch.Tensor
    prefix: tuple[KeySpan, ...] = ()


class HSTULayer(nn.Module):
    def __init__(self, c: HSTUConfig):
        super().__init__()
        self.heads, self.head_dim = c.num_attention_heads, c.head_dim
        width = c.num_attention_heads * c.head_dim
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.uvqk = nn.Linear(c.hidden_size, 4 * width)  # output rows: u, v, q, k (each heads × head_dim)
        self.attn_norm = nn.LayerNorm(width, eps=c.layer_norm_eps)
        self.out = nn.Linear(width, c.hidden_size)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., hidden] -> u, v, q, k, each [..., heads, head_dim], SiLU applied."""
        return self.projected(self.norm(x))

    def projected(self, normed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`project` of an input already normalised."""
        uvqk = F.silu(self.uvqk(normed))
        return uvqk.view(*normed.shape[:-1], 4, self.heads, self.head_dim).unbind(-3)

    def gated(self, u: torch.Tensor, attn: torch.Tensor, scale: float, ops: Pieces = fused.PLAIN) -> torch.Tensor:
        """Gate and output projection of attn [..., heads, head_dim] times `scale` (1 / N): the layer's output."""
        norm = self.attn_norm
        return self.out(ops.gated_norm(u, attn, norm.weight, norm.bias, norm.eps, scale))

    def finish(self, x: torch.Tensor, u: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Gate, output projection, residual; attn [..., heads, head_dim] already divided by N."""
        return x + self.gated(u, attn, 1.0)


class TaskHead(nn.Module):
    """Per-candidate MLP: hidden -> head_hidden -> SiLU -> one logit per task."""

    def __init__(self, c: HSTUConfig):
        super().__init__()
        self.hidden = nn.Linear(c.hidden_size, c.head_hidden)
        self.out = nn.Linear(c.head_hidden, len(c.tasks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.silu(self.hidden(x)))


class HSTU(nn.Module):
    """Parameter names (the safetensors keys) are stable: item_embedding, action_embedding, position_embedding,
    bucket_embedding (time buckets only), layers.{i}.{norm,uvqk,attn_norm,out}, final_norm, head.{hidden,out}."""

    def __init__(self, config: HSTUConfig):
        super().__init__()
        c = self.config = config
        self.item_embedding = loaded_embedding(c.num_items, c.hidden_size)
        self.action_embedding = loaded_embedding(c.num_actions + 1, c.hidden_size)
        self.position_embedding = loaded_embedding(c.max_positions, c.hidden_size)
        if c.num_time_buckets:
            self.bucket_embedding = loaded_embedding(c.num_time_buckets + 1, c.hidden_size)
        self.layers = nn.ModuleList(HSTULayer(c) for _ in range(c.num_hidden_layers))
        self.final_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.head = TaskHead(c)
        self.scale = c.head_dim**-0.5
        self.inv_normalizer = 1.0 / c.attention_normalizer

    @property
    def device(self) -> torch.device:
        return self.item_embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.item_embedding.weight.dtype

    def embed_events(
        self,
        items: torch.Tensor,
        actions: torch.Tensor | None,
        positions: torch.Tensor,
        buckets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Item + action + position (+ bucket) embeddings, [T, hidden]. Index tensors are [T] int64 and must be
        in range (validated by the caller: no device sync here). actions None = no action on every event;
        buckets None = the unknown bucket (and must be None when the config has no time buckets)."""
        c = self.config
        if actions is None:
            actions = torch.full_like(items, c.no_action)
        x = self.item_embedding(items) + self.action_embedding(actions) + self.position_embedding(positions)
        if c.num_time_buckets:
            if buckets is None:
                buckets = torch.full_like(items, c.unknown_bucket)
            x = x + self.bucket_embedding(buckets)
        elif buckets is not None:
            raise ValueError("buckets given, but the model has no time-bucket feature (num_time_buckets is 0)")
        return x

    @torch.inference_mode()
    def prefill(self, embeds: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int) -> torch.Tensor:
        """Events embeds [n, hidden] at positions start.., after `start` events in k_cache/v_cache [layers, capacity,
        heads, head_dim], where their K/V are written; returns hidden [n, hidden] before the final norm."""
        return self.prefill_packed([HistorySegment(embeds, k_cache, v_cache, start)])

    @torch.inference_mode()
    def prefill_packed(self, segments: list[HistorySegment], ops: ModelOps = PLAIN_OPS) -> torch.Tensor:
        """Several users' new events in one pass: projections over all tokens at once, attention per user.
        Returns the hidden states of all segments' events, concatenated in order."""
        for s in segments:
            if s.start < 0 or s.start + len(s.embeds) > s.k_cache.shape[1]:
                raise ValueError(
                    f"events {s.start}..{s.start + len(s.embeds)} do not fit a cache of {s.k_cache.shape[1]}"
                )
        x = segments[0].embeds if len(segments) == 1 else torch.cat([s.embeds for s in segments])

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            parts, first = [], 0
            for s in segments:
                n, stop = len(s.embeds), s.start + len(s.embeds)
                s.k_cache[i, s.start : stop] = k[first : first + n]
                s.v_cache[i, s.start : stop] = v[first : first + n]
                part = self._causal(q[first : first + n], s.k_cache[i, :stop], s.v_cache[i, :stop], s.start)
                for span in s.prefix:  # earlier events: every new one sees all of them
                    part += self._over(q[first : first + n], span.k[i], span.v[i])
                parts.append(part)
                first += n
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        return self._layers(x, attend, ops.pieces)

    def _layers(self, x: torch.Tensor, attend, ops: Pieces) -> torch.Tensor:
        """The layers over x [..., hidden]; `attend(i, q, k, v)` is layer i's attention sum (not yet divided by N).
        Each residual add is fused with the next layer's norm. Returns the hidden states before the final norm."""
        layers = self.layers
        normed = layers[0].norm(x)
        for i, layer in enumerate(layers):
            u, v, q, k = layer.projected(normed)
            out = layer.gated(u, attend(i, q, k, v), self.inv_normalizer, ops)
            if i + 1 < len(layers):
                norm = layers[i + 1].norm
                normed, x = ops.add_layer_norm(out, x, norm.weight, norm.bias, norm.eps)
        return x + out

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """q [n, H, D] at positions start.. over k, v [start+n, H, D]: Σ_{j ≤ position} SiLU(q·k_j/√d) v_j, [n, H, D]
        (not divided by N). Queries go in chunks over the keys they may see: the score matrix stays bounded and the
        masked-out upper triangle is mostly never computed."""
        if not len(q):
            return torch.zeros_like(q)
        out = []
        for a in range(0, len(q), PREFILL_QUERY_CHUNK):
            b = min(a + PREFILL_QUERY_CHUNK, len(q))
            keys = start + b
            scores = F.silu(torch.matmul(q[a:b].transpose(0, 1), k[:keys].permute(1, 2, 0)) * self.scale)
            scores.tril_(diagonal=start + a)  # query i (position start+a+i) sees keys 0 .. start+a+i
            out.append(torch.matmul(scores, v[:keys].transpose(0, 1)).transpose(0, 1))
        return out[0] if len(out) == 1 else torch.cat(out)

    @torch.inference_mode()
    def forward_candidates(
        self, embeds: torch.Tensor, groups: list[HistoryRows], ops: ModelOps = PLAIN_OPS
    ) -> torch.Tensor:
        """Candidate rows embeds [R, hidden], each over its group's history (one product per group) and itself (rows in
        no group: itself only); returns hidden [R, hidden] before the final norm, for `task_probs`."""
        pieces = ops.pieces

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            attn = pieces.own_attention(q, k, v, self.scale)  # each row's own part, [R, H, D]
            for g in groups:
                if g.stop > g.start:
                    for span in (*g.prefix, KeySpan(g.k, g.v)):
                        attn[g.start : g.stop] += self._over(q[g.start : g.stop], span.k[i], span.v[i])
            return attn

        return self._layers(embeds, attend, pieces)

    def _over(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Queries q [n, H, D] over every key of k, v [T, H, D]: Σ_j SiLU(q·k_j/√d) v_j, [n, H, D] (not divided
        by N). One product for all queries; T = 0 gives zeros."""
        if not k.shape[0] or not q.shape[0]:
            return torch.zeros_like(q)
        scores = F.silu(torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)) * self.scale)
        return torch.matmul(scores, v.transpose(0, 1)).transpose(0, 1)

    # -- the engine's calls: histories held as genrec ContextKVs (prefix pieces of the pool, then its own extent) --

    @torch.inference_mode()
    def prefill_contexts(self, segments: list[tuple[torch.Tensor, object]], ops: ModelOps = PLAIN_OPS) -> None:
        """Each (embeds [n, hidden], ctx): n new events after the ctx.length ready ones, written into ctx."""
        history = [
            HistorySegment(embeds, ctx.extent.k(), ctx.extent.v(), ctx.length - ctx.prefix_length, _prefix(ctx))
            for embeds, ctx in segments
        ]
        self.prefill_packed(history, ops)
        for embeds, ctx in segments:
            ctx.length += len(embeds)

    @torch.inference_mode()
    def candidates_over(self, embeds: torch.Tensor, groups: list, ops: ModelOps = PLAIN_OPS) -> torch.Tensor:
        """Candidate rows over their request's context (`ContextGroup`s): hidden [R, hidden] for `task_probs`."""
        rows = []
        for g in groups:
            own = g.ctx.length - g.ctx.prefix_length
            k, v = g.ctx.extent.k()[:, :own], g.ctx.extent.v()[:, :own]
            rows.append(HistoryRows(g.start, g.stop, k, v, _prefix(g.ctx)))
        return self.forward_candidates(embeds, rows, ops)

    def task_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + multi-task head on hidden states [R, hidden]: [R, tasks] in float32."""
        return self.head(self.final_norm(hidden)).float()

    @torch.inference_mode()
    def task_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Per-task probabilities [R, tasks] (sigmoid of the logits), float32, tasks in config order."""
        return torch.sigmoid(self.task_logits(hidden))

    def save(self, out: str | Path, dtype: torch.dtype | None = None) -> Path:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        body = self.config.to_dict()
        body["torch_dtype"] = str(dtype or self.dtype).removeprefix("torch.")
        (out / "config.json").write_text(json.dumps(body, indent=2))
        state = {n: p.detach().to("cpu", dtype or p.dtype).contiguous() for n, p in self.state_dict().items()}
        write_atomically(out / "model.safetensors", save(state))
        return out


def _prefix(ctx) -> tuple[KeySpan, ...]:
    pool = ctx.pool
    return tuple(
        KeySpan(pool.k[:, p.start : p.start + p.length], pool.v[:, p.start : p.start + p.length]) for p in ctx.prefix
    )


def meta_hstu(config: HSTUConfig) -> HSTU:
    with torch.device("meta"):
        return HSTU(config)


def checkpoint_layout(model: HSTU) -> Layout:
    """The tensors a checkpoint of the model holds: exactly its parameters (`HSTU.save` writes no other, so
    another tensor means a config that is not the checkpoint's, e.g. time buckets turned off)."""
    return Layout.of(model, closed=True)


def load_hstu(config: HSTUConfig, tensors: dict, model_dir, device="cpu", dtype: torch.dtype = torch.float32) -> HSTU:
    """An HSTU from a checkpoint's tensors, each checked by name, dtype and shape (`checkpoint_layout`)."""
    model = meta_hstu(config)
    assign_weights(model, checkpoint_layout(model), tensors, model_dir, device, dtype)
    return model.eval().requires_grad_(False)
