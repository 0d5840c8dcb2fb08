"""The elementwise pieces of a layer (what lies between two matrix products), each one plain torch function.

Eager they are the reference; `compiled()` compiles them, for a CUDA execution plan (docs/engine.md, 'KV memory
and the execution plan'), with automatic dynamic shapes: the axes that change (rows, tokens) go symbolic, the model's
sizes stay constant and the reductions single-pass (on an H200 faster than `dynamic=True`: a 5,000-token prefill
40.2 vs 42.2 ms, its q/k norm + RoPE 1.1 vs 4.0 ms). No "reduce-overhead": the runner captures whole passes.
Numerics are transformers': each norm normalises in float32, rounds to the input's dtype, then scales.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from genrec.attention.merge import merge_spans, suffix_merge

log = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm over the last axis; weight [..., dim] may differ per head (q/k norm). torch's rms_norm computes
    in float32 and rounds to x's dtype, as transformers does by casting: no cast of its own."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """A sublayer's output x added to the residual stream, then the next RMSNorm: (normed, new residual)."""
    h = x + residual
    return rms_norm(h, weight, eps), h


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [..., heads, head_dim] by cos/sin [..., head_dim] (broadcast over heads)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


def qk_norm_rope(qk: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float):
    """Qwen3's per-head q/k RMSNorm (weight [heads, head_dim]: q's and k's rows) and the rotation after it."""
    return rope(rms_norm(qk, weight, eps), cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The MLP's SiLU(gate) · up from the fused gate_up product's output [..., 2 * intermediate]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float):
    """HSTU: a layer's output added to the residual stream, then the next layer's LayerNorm: (normed, residual)."""
    h = x + residual
    return F.layer_norm(h, (h.shape[-1],), weight, bias, eps), h


def gated_norm(u, attn, weight: torch.Tensor, bias: torch.Tensor, eps: float, scale: float) -> torch.Tensor:
    """HSTU: u ⊙ LayerNorm(attn · scale), u and attn [..., heads, head_dim] flattened over the heads."""
    a = attn.flatten(-2) * scale
    return u.flatten(-2) * F.layer_norm(a, (a.shape[-1],), weight, bias, eps)


def own_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """HSTU: each row over its own key only, SiLU(q·k·scale) v, [..., heads, head_dim] (not divided by N)."""
    return F.silu((q * k).sum(-1, keepdim=True) * scale) * v


def column_logprobs(logits: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The float32 log-softmax of logits [R, vocab] at columns [R, C] only. Compiled, Inductor computes the row max
    and sum, then the log-softmax only where the gather reads it: its buffers are [R, 1] and [R, C], never [R, vocab]
    (read from its generated code). Eager (the CPU) it is torch's log-softmax kernel, faster there than logsumexp
    (51 vs 72 ms for 256 rows of Qwen3's 151,936) and the same numbers as before the pass ended at the columns."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, columns)


def candidate_scores(scores: torch.Tensor, gains: torch.Tensor, allowed: torch.Tensor, free) -> torch.Tensor:
    """A beam search's candidates [R, C]: each row's score [R] plus its children's log-probabilities gains [R, C],
    0 where `free` [R, C] (a finished code's pad step keeps its score; None: nowhere), -inf where not `allowed`."""
    gains = gains if free is None else gains.masked_fill(free, 0.0)
    return (scores[:, None] + gains).masked_fill(~allowed, float("-inf"))


def selection_keys(scores, gains, allowed, free, segment: torch.Tensor):
    """The candidates (`candidate_scores`) and int64 sort keys [R, C] that order them by segment [R] (a row's
    request), then best first: the float's bits made monotonic as a signed int32, flipped to descending in the low
    32 bits. Sorting the keys is every request's top-k at once, in fixed shapes
    (genrec.engine.selection.select_ranked)."""
    cand = candidate_scores(scores, gains, allowed, free)
    if cand.dtype != torch.float32:  # its bits are read as int32: another width would misread them silently
        raise TypeError(f"selection keys need float32 candidates, got {cand.dtype}")
    bits = cand.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # a negative float's other bits count the other way
    return cand, (segment[:, None] << 32) + (0x7FFFFFFF - ordered)


@dataclass(frozen=True)
class Pieces:
    rms_norm: Callable
    add_rms_norm: Callable
    rope: Callable
    qk_norm_rope: Callable
    silu_mul: Callable
    suffix_merge: Callable  # genrec.attention.merge: a row's own suffix, merged with its context part
    merge_spans: Callable  # genrec.attention.merge: a decode pass's partial attentions over a context's spans, as one
    add_layer_norm: Callable
    gated_norm: Callable
    own_attention: Callable
    column_logprobs: Callable  # a decode pass's log-probabilities at the trie's columns (genrec.engine.beam)
    selection_keys: Callable  # a decode pass's candidates and their sort keys, where it selects itself


PLAIN = Pieces(
    rms_norm,
    add_rms_norm,
    rope,
    qk_norm_rope,
    silu_mul,
    suffix_merge,
    merge_spans,
    add_layer_norm,
    gated_norm,
    own_attention,
    column_logprobs,
    selection_keys,
)


@functools.cache
def compiled(backend: str = "inductor", key: str = "") -> Pieces:
    """The pieces compiled for one kind of engine (`key`: its dtype and model shape), once per process; each piece
    compiles at its first call (the engine's warm-up). `backend`: Inductor; the tests' "eager" runs Dynamo alone (its
    guards, its cache entries and their limit) on the CPU."""
    return Pieces(**{f.name: CompiledPiece(getattr(PLAIN, f.name), backend) for f in fields(Pieces)})


class CompiledPiece:
    """A piece compiled whole (fullgraph) from its own copy of the function's code. Dynamo keeps its cache entries,
    and their limit (8), per code object: each kind of engine's copy counts only its own shapes (a prefill's and a
    decode's ranks, a 1-row pass), never another model size's or dtype's in the same process. A shape past the limit
    runs the plain function (logged once), never fails a request."""

    def __init__(self, fn: Callable, backend: str):
        from torch._dynamo.exc import FailOnRecompileLimitHit  # here: a process that never compiles never imports it

        self.limit_hit = FailOnRecompileLimitHit
        self.plain, self.code = fn, fn.__code__.replace()  # a new code object: its own cache
        own = types.FunctionType(self.code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        self.compiled = torch.compile(own, fullgraph=True, dynamic=None, backend=backend)
        self.fallbacks = 0  # calls that ran plain, past the recompile limit

    def __call__(self, *args, **kwargs):
        try:
            return self.compiled(*args, **kwargs)
        except self.limit_hit:
            if not self.fallbacks:
                log.warning("genrec: %s met more shapes than Dynamo compiles; those run eagerly", self.plain.__name__)
            self.fallbacks += 1
            return self.plain(*args, **kwargs)

    @property
    def entries(self) -> int:
        """Dynamo's cache entries for this piece: the shapes (guards) it compiled for."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return len(_debug_get_cache_entry_list(self.code))
