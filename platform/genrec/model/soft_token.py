"""The soft-token projector: a learned linear map from a user embedding into the model's hidden size."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from genrec.errors import ModelDirectoryError


class SoftTokenProjector(nn.Linear):
    """`weight @ user_embedding + bias`, stored as `genrec/soft_token.safetensors` (weight [H, U], bias [H])."""

    @property
    def user_dim(self) -> int:
        return self.in_features

    @classmethod
    def load(cls, path: Path, hidden_size: int) -> SoftTokenProjector:
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as err:
            raise ModelDirectoryError(path, f"cannot read soft-token projector ({err})") from None
        weight, bias = tensors.get("weight"), tensors.get("bias")
        if weight is None or bias is None:
            raise ModelDirectoryError(path, "soft-token projector needs tensors 'weight' and 'bias'")
        if weight.ndim != 2 or weight.shape[0] != hidden_size or tuple(bias.shape) != (hidden_size,):
            raise ModelDirectoryError(
                path,
                f"soft-token shapes weight {tuple(weight.shape)} / bias {tuple(bias.shape)} do not match "
                f"hidden size {hidden_size} (expected weight [{hidden_size}, user_dim], bias [{hidden_size}])",
            )
        projector = cls(weight.shape[1], hidden_size)
        with torch.no_grad():
            projector.weight.copy_(weight)
            projector.bias.copy_(bias)
        return projector

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"weight": self.weight.detach().contiguous(), "bias": self.bias.detach().contiguous()}, str(path))
