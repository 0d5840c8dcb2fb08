"""Soft-token injection: the projected user vector replaces every `<|user|>` placeholder's embedding."""

from __future__ import annotations

import torch

from genrec.errors import InvalidRequestError
from genrec.model.soft_token import SoftTokenProjector
from genrec.staging import to_device


def check_user_embedding(
    token_ids: torch.Tensor,
    placeholder_id: int | None,
    user_embedding: list[float] | None,
    projector: SoftTokenProjector | None,
) -> None:
    has_placeholder = placeholder_id is not None and bool((token_ids == placeholder_id).any())
    if user_embedding is None:
        if has_placeholder:
            raise InvalidRequestError("user_embedding", "the prompt has a <|user|> placeholder but no user_embedding")
        return
    if projector is None:
        raise InvalidRequestError(
            "user_embedding", "this model has no soft-token projector (genrec/soft_token.safetensors)"
        )
    if len(user_embedding) != projector.user_dim:
        raise InvalidRequestError(
            "user_embedding", f"has {len(user_embedding)} values; this model's projector expects {projector.user_dim}"
        )
    if not has_placeholder:
        raise InvalidRequestError("user_embedding", "was given but the prompt has no <|user|> placeholder token")
    dtype = projector.weight.dtype
    limit = torch.finfo(dtype).max / 2  # margin for rounding in the device's sums
    if max(map(abs, user_embedding)) > limit or projector.largest_partial_sum(user_embedding) > limit:
        raise InvalidRequestError(
            "user_embedding", f"values are too large for this model: projecting them would overflow {dtype}"
        )


def inject_user_embedding(
    embeds: torch.Tensor, token_ids: torch.Tensor, placeholder_id: int, user_embedding: list[float], projector
) -> torch.Tensor:
    """embeds [T, hidden] of token_ids [T] (a whole prompt or a chunk of it, already checked by
    `check_user_embedding`): placeholder rows replaced by one projected vector for all."""
    vector = to_device(user_embedding, projector.weight.device, torch.float32).to(projector.weight.dtype)
    projected = projector(vector).to(embeds.dtype)
    mask = to_device(token_ids.numpy() == placeholder_id, embeds.device, torch.bool)
    return torch.where(mask[:, None], projected[None, :], embeds)
