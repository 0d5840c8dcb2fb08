"""The soft-token projector: a learned linear map from a user embedding into the model's hidden size."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch import nn

from genrec.errors import ModelDirectoryError
from genrec.files import write_atomically


class SoftTokenProjector(nn.Linear):
    """`weight @ user_embedding + bias`, stored as `genrec/soft_token.safetensors` (weight [H, U], bias [H])."""

    @property
    def user_dim(self) -> int:
        return self.in_features

    def largest_partial_sum(self, user_embedding: list[float]) -> float:
        """max_i sum_j |W_ij v_j| + |b_i|, in float64 on the host: no partial sum of the projection, in any order,
        is larger. Host copies of |W| and |b| are taken once (a serving projector's weights do not change)."""
        if "_abs_host" not in self.__dict__:
            self._abs_host = tuple(t.detach().abs().double().cpu() for t in (self.weight, self.bias))
        weight, bias = self._abs_host
        return float((weight @ torch.tensor(user_embedding, dtype=torch.float64).abs() + bias).max())

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
        if not (weight.is_floating_point() and bias.is_floating_point()):
            raise ModelDirectoryError(path, f"soft-token tensors must be floating point ({weight.dtype}, {bias.dtype})")
        if not (torch.isfinite(weight).all() and torch.isfinite(bias).all()):
            raise ModelDirectoryError(path, "soft-token projector has non-finite values (NaN or infinity)")
        projector = cls(weight.shape[1], hidden_size)
        with torch.no_grad():
            projector.weight.copy_(weight)
            projector.bias.copy_(bias)
        return projector

    def save(self, path: Path) -> None:
        tensors = {"weight": self.weight.detach().contiguous(), "bias": self.bias.detach().contiguous()}
        write_atomically(path, save(tensors))
