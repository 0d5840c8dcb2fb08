"""Our Qwen3 forward pass, equal to transformers' `Qwen3ForCausalLM` and, configured as Qwen2, to `Qwen2ForCausalLM`
(docs/engine.md, 'Two decoder architectures: Qwen3 and Qwen2').

`prefill` runs a prompt (or a chunk) and writes its K/V into a `ContextKV`; `forward_rows` runs R short rows (beams,
candidates), each over its request's ContextKV (shared, never copied) plus its own causal suffix (`genrec.attention`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from genrec.attention import PrefillRows, shared_context_attention
from genrec.model import fused
from genrec.model.config import Qwen3Config
from genrec.model.fused import PLAIN, Pieces
from genrec.model.kv_pool import ContextKV
from genrec.model.ops import PLAIN_OPS, ModelOps
from genrec.model.weights import Layout, assign_weights, loaded_embedding
from genrec.staging import to_device


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        # On the CPU even when built on meta (there the sum would import torch's compiler); moved with the model.
        steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
        inv_freq = 1.0 / (theta ** (steps / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)  # once per pass, read by every layer


class MLP(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.gate_up: nn.Module | None = None  # [hidden] -> [2 * intermediate] after fuse()

    def fuse(self) -> None:
        """One matrix product for gate and up; the original weights become views of the fused one."""
        self.gate_up = _fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor, ops: Pieces = PLAIN) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up(x)))


class Attention(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps) if c.arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps) if c.arch.qk_norm else None
        self.scale = self.head_dim**-0.5
        self.eps = c.rms_norm_eps
        self.qkv: nn.Module | None = None  # [hidden] -> [(heads + 2 * kv_heads) * head_dim] after fuse()
        self.qk_norm: torch.Tensor | None = None  # [heads + kv_heads, head_dim] after fuse(), with q/k norm

    def fuse(self) -> None:
        """One product for q, k and v; one norm and one rotation over the q and k heads together. Whether q and k
        are normalised is settled here, once, not on every pass."""
        self.qkv = _fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        if self.q_norm is not None:
            self.qk_norm = torch.cat(
                [self.q_norm.weight.expand(self.heads, -1), self.k_norm.weight.expand(self.kv_heads, -1)]
            )

    def qkv_heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ops: Pieces = PLAIN):
        """x: [..., hidden] -> q [..., heads, hd], k/v [..., kv_heads, hd] with q/k norm (if any) and RoPE applied."""
        lead = x.shape[:-1]
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        projected = self.qkv(x)
        qk = projected[..., : (H + KV) * D].view(*lead, H + KV, D)
        v = projected[..., (H + KV) * D :].view(*lead, KV, D)
        if self.qk_norm is None:
            qk = ops.rope(qk, cos, sin)
        else:
            qk = ops.qk_norm_rope(qk, self.qk_norm, cos, sin, self.eps)
        return qk[..., :H, :], qk[..., H:, :], v


class FusedLinear(nn.Module):
    """The product of several linears fused into one weight (theirs become views of it). Its tensors are plain
    attributes, not parameters: the projections it fuses own them (a checkpoint names those)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _fuse_linears(*linears: nn.Linear) -> FusedLinear:
    weight = torch.cat([lin.weight for lin in linears])
    bias = torch.cat([lin.bias for lin in linears]) if linears[0].bias is not None else None
    start = 0
    for lin in linears:  # re-point the parameters into the fused storage: no second copy in memory
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return FusedLinear(weight, bias)


class DecoderLayer(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Qwen3Backbone(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.embed_tokens = loaded_embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Qwen3(nn.Module):
    """Parameter names match the Hugging Face checkpoint (`model.layers.0.self_attn.q_proj.weight`, ...), of a
    Qwen3 or a Qwen2 model (`config.architecture`)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.model = Qwen3Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config.head_dim, config.rope_theta)

    def fuse(self) -> Qwen3:
        """Fuse projections for inference (fewer, larger kernels); numerically the same model.
        The forward pass needs it: `load_qwen3` calls it once the weights are in."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._head(hidden).float()

    def column_logprobs(self, hidden: torch.Tensor, columns: torch.Tensor, ops: ModelOps = PLAIN_OPS) -> torch.Tensor:
        """The next token's float32 log-probabilities after hidden [R, hidden] at columns [R, C] only (fused.py: the
        cast to float32 inside the compiled piece, so no float32 [R, vocab] copy is made first)."""
        return ops.pieces.column_logprobs(self._head(hidden), columns)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head: logits [..., vocab] in the model's dtype."""
        return self.lm_head(self.model.norm(hidden))

    @torch.inference_mode()
    def prefill(
        self, embeds: torch.Tensor, ctx: ContextKV, logits_at: torch.Tensor | None = None, ops: ModelOps = PLAIN_OPS
    ) -> torch.Tensor:
        """Embeds [S, hidden] as prompt positions ctx.length.., their K/V written into `ctx` (which must have room);
        float32 logits at `logits_at` (chunk-relative indices; default: the last position)."""
        hidden = self._prefill_hidden([(embeds, ctx)], ops)
        return self.logits(hidden[-1:] if logits_at is None else hidden[logits_at])

    @torch.inference_mode()
    def prefill_packed(
        self, segments: list[tuple[torch.Tensor, ContextKV]], ops: ModelOps = PLAIN_OPS, graphs=None
    ) -> torch.Tensor:
        """Several prompts (or chunks) in one pass: projections and MLPs over all their tokens, attention per segment;
        logits [n, vocab] at each segment's last position. `graphs` (`genrec.engine.prefill_graphs`): the captured
        stages, replayed where a bucket holds the pass."""
        hidden = self._prefill_hidden(segments, ops, graphs)
        ends = to_device(np.cumsum([len(e) for e, _ in segments]) - 1, hidden.device)
        return self.logits(hidden[ends])

    def _prefill_hidden(self, segments: list[tuple[torch.Tensor, ContextKV]], ops: ModelOps, graphs=None):
        """The layers over the segments' tokens, stage by stage (`prefill_stage`, then its layer's K/V writes), eager
        or replayed from `graphs` (a bucket of at least as many tokens); the attention runs eagerly between them."""
        device = segments[0][0].device
        positions = np.concatenate([np.arange(ctx.length, ctx.length + len(e)) for e, ctx in segments])
        writes = _kv_writes(segments, device)
        for embeds, ctx in segments:
            ctx.length += len(embeds)  # written layer by layer below, before each layer's attention reads it
        x = segments[0][0] if len(segments) == 1 else torch.cat([e for e, _ in segments])
        n = len(x)
        cos, sin = self.rotary.cos_sin(to_device(positions, device), x.dtype)
        cu_q = [0, *np.cumsum([len(e) for e, _ in segments]).tolist()]
        rows = PrefillRows([ctx for _, ctx in segments], cu_q, ops.attention)
        stages = None if graphs is None else graphs.stages(n, writes)
        stages = stages or EagerStages(self, ops.pieces, writes)
        x, q = stages.first(x, cos, sin)
        for i, layer in enumerate(self.model.layers):
            x, q = stages.next(i + 1, rows.attend(q[:n], i, layer.self_attn.scale))
        return x[:n]

    def prefill_stage(self, i: int, x, attn, cos, sin, ops: Pieces):
        """Stage i of a prefill (`_stage`, then below L layer i's q, k, v): (x: the residual stream, q, k, v); at L
        (hidden states before the final norm, None, None, None)."""
        normed, x = self._stage(i, x, attn, ops)
        if normed is None:
            return x, None, None, None
        return (x, *self.model.layers[i].self_attn.qkv_heads(normed, cos, sin, ops))

    def _stage(self, i: int, x: torch.Tensor, attn: torch.Tensor | None, ops: Pieces):
        """From layer i-1's attention output `attn` (none at i == 0) to layer i's normed input: (normed, residual
        stream); at i == L: (None, hidden states before the final norm). Each residual add is fused with its norm."""
        layers, eps = self.model.layers, self.config.rms_norm_eps
        if i == 0:
            return ops.rms_norm(x, layers[0].input_layernorm.weight, eps), x
        layer = layers[i - 1]
        out = layer.self_attn.o_proj(attn.flatten(-2))
        normed, x = ops.add_rms_norm(out, x, layer.post_attention_layernorm.weight, eps)
        mlp = layer.mlp(normed, ops)
        if i == len(layers):
            return None, x + mlp
        return ops.add_rms_norm(mlp, x, layers[i].input_layernorm.weight, eps)

    def _layers(self, x: torch.Tensor, attend, ops: Pieces) -> torch.Tensor:
        """The decoder layers over x [..., hidden]; `attend(i, layer, normed)` is layer i's attention (its output
        [..., heads, head_dim]). Returns the hidden states before the final norm."""
        normed, x = self._stage(0, x, None, ops)
        for i, layer in enumerate(self.model.layers):
            normed, x = self._stage(i + 1, x, attend(i, layer, normed), ops)
        return x

    @torch.inference_mode()
    def forward_rows(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        context,
        past: tuple | None = None,
        causal: bool = True,
        mask: torch.Tensor | None = None,
        ops: ModelOps = PLAIN_OPS,
    ):
        """R rows of S new tokens: embeds [R, S, hidden], positions [R, S]. `context` (anything with `at_layer(i)`:
        `ContextRows`, a static pass's `StaticContext`) says which ContextKV each row reads; then its own suffix:
        `past` (k, v [layers, T, kv_heads, hd], at [R, P]: the K/V of each row's P earlier tokens, e.g. a beam's
        ancestors in the pool, read where they lie) and its S new tokens, causal when `causal`. An explicit `mask`
        [R or 1, S, P+S] (True = may attend) replaces that rule (e.g. padded past).
        Returns (hidden [R, S, hidden] before the final norm, new_k, new_v [layers, R, S, kv_heads, hd])."""
        R, S = positions.shape
        cos, sin = self.rotary.cos_sin(positions, embeds.dtype)
        P = 0 if past is None else past[2].shape[1]
        if mask is None and causal and S > 1:
            u = torch.arange(P + S, device=embeds.device)
            mask = (u[None, :] <= (torch.arange(S, device=embeds.device)[:, None] + P))[None]
        new_k, new_v = [], []
        pieces = ops.pieces

        def attend(i: int, layer: DecoderLayer, normed: torch.Tensor) -> torch.Tensor:
            q, k, v = layer.self_attn.qkv_heads(normed, cos, sin, pieces)
            new_k.append(k)
            new_v.append(v)
            layer_past = None if past is None else (past[0][i], past[1][i], past[2])
            return shared_context_attention(
                q, context.at_layer(i), k, v, mask, layer.self_attn.scale, pieces.suffix_merge, layer_past
            )

        x = self._layers(embeds, attend, pieces)
        return x, torch.stack(new_k), torch.stack(new_v)


class EagerStages:
    """A prefill's stages run as they come (the CPU, or a pass no captured bucket holds): each stage below the last
    writes its layer's K/V where `writes` (`_kv_writes`) say, as a captured stage does."""

    def __init__(self, model: Qwen3, ops: Pieces, writes: list):
        self.model, self.ops, self.writes = model, ops, writes

    def first(self, x, cos, sin):
        self.x, self.cos, self.sin = x, cos, sin
        return self.next(0, None)

    def next(self, i: int, attn):
        self.x, q, k, v = self.model.prefill_stage(i, self.x, attn, self.cos, self.sin, self.ops)
        if q is not None:
            for pool, slots, tokens in self.writes:
                pool.k[i].index_copy_(0, slots, k if tokens is None else k[tokens])
                pool.v[i].index_copy_(0, slots, v if tokens is None else v[tokens])
        return self.x, q


def _kv_writes(segments: list[tuple[torch.Tensor, ContextKV]], device) -> list:
    """Where a prefill pass writes its tokens' K/V, built once for every layer: per pool, (pool, slots [n] int64,
    the pass's token rows that go there or None for all of them), so each layer writes with one index copy."""
    by_pool, first = {}, 0
    for embeds, ctx in segments:
        at = ctx.own_offset(ctx.length)
        _, slots, tokens = by_pool.setdefault(id(ctx.pool), (ctx.pool, [], []))
        slots.append(np.arange(at, at + len(embeds)))
        tokens.append(np.arange(first, first + len(embeds)))
        first += len(embeds)
    writes = []
    for pool, slots, tokens in by_pool.values():
        tokens = np.concatenate(tokens)
        index = None if len(tokens) == first else to_device(tokens, device)
        writes.append((pool, to_device(np.concatenate(slots), device), index))
    return writes


def meta_qwen3(config: Qwen3Config) -> Qwen3:
    with torch.device("meta"):
        return Qwen3(config)


def checkpoint_layout(model: Qwen3) -> Layout:
    """The tensors a checkpoint of the model holds: every parameter; with tied embeddings lm_head.weight may be
    left out (the embedding matrix is the head too). Other tensors are ignored, as transformers ignores them."""
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if model.config.tie_word_embeddings else {}
    return Layout.of(model, tied=tied)


def load_qwen3(
    config: Qwen3Config, tensors: dict, model_dir, device="cpu", dtype: torch.dtype = torch.float32
) -> Qwen3:
    """Our Qwen3 from a checkpoint's tensors, each checked by name, dtype and shape (`checkpoint_layout`), fused."""
    model = meta_qwen3(config)
    assign_weights(model, checkpoint_layout(model), tensors, model_dir, device, dtype)
    model.rotary = Rotary(config.head_dim, config.rope_theta).to(device)
    return model.eval().requires_grad_(False).fuse()
