"""The seam between the engine and a model family: what the engine's runner calls, and nothing else.

A family's model keeps its context (a prompt, or a user's event history) as per-layer K/V in a token-major
`KVPool` extent (`ContextKV`), so any number of rows can read one context without copying it. Qwen3 (the
semantic-ID decoder, `genrec.model.qwen3`) is the first implementation; a ranking family implements the same
calls with its own inputs and outputs.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KVShape(Protocol):
    """What a `KVPool` needs of a model's config to hold its K/V."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int


class ContextModel(Protocol):
    config: KVShape

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings of token (or event) IDs."""

    def prefill_packed(self, segments: list[tuple[torch.Tensor, object]], fast: bool = False) -> torch.Tensor:
        """Embed a prompt into its context: each (embeds [n, hidden], ctx) runs as positions ctx.length .. + n,
        written into ctx (several contexts in one pass). Returns the outputs at each segment's last position."""

    def forward_rows(self, embeds, positions, context, past_k=None, past_v=None, causal=True, mask=None):
        """Run rows over contexts: rows [R, S] each read their request's context (`context.at_layer(i)`) and their
        own suffix. Returns (hidden [R, S, hidden], new_k, new_v)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Task outputs of hidden states (Qwen3: next-token logits, float32)."""


def family_of(model) -> str:
    """The family: "hstu" for a ranking model (history in, task probabilities per candidate out), else "qwen3"."""
    return "hstu" if hasattr(model, "candidates_over") else "qwen3"
