"""The mean of a model's weights over its last training steps (Polyak / stochastic weight averaging).

With the learning rate annealed to zero, the last steps' weights differ by the noise of their batches; their mean
cancels much of it, so what a run ends with depends less on its draw (initial values, batch order, negatives)."""

from __future__ import annotations

import torch
from torch import nn


class WeightAverage:
    def __init__(self, model: nn.Module):
        self.model = model
        self.sum = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
        self.count = 0

    @torch.no_grad()
    def add(self) -> None:
        for name, p in self.model.named_parameters():
            self.sum[name] += p
        self.count += 1

    @torch.no_grad()
    def apply(self) -> None:
        """Set the model's weights to the mean of those added (unchanged when none were)."""
        if not self.count:
            return
        for name, p in self.model.named_parameters():
            p.copy_(self.sum[name] / self.count)
