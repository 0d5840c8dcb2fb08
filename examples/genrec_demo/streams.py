"""Named random streams: every parameter of a demo model is drawn from a generator of its own, seeded by the run's
seed, the model's name and the parameter's name.

torch's global stream hands out draws in construction order, so building one module differently (an embedding
that no longer draws, a layer added) moves every later parameter's draw, and the trained model with it: a recipe
whose figures change without any change to the recipe. Here a parameter's initial value depends only on
(seed, model, parameter name) and its scale.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn


def generator(seed: int, *names: str) -> torch.Generator:
    """A CPU generator of its own for this seed and these names (stable across runs, machines and Python hashes)."""
    digest = hashlib.sha256("/".join([str(seed), *names]).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


@torch.no_grad()
def initialise(model: nn.Module, seed: int, stream: str, embedding_std: float, weight_std: float | None = None) -> None:
    """Draw every parameter of `model` again from its named stream.

    Vectors: a norm's gain (`...weight`) 1, every bias 0. Matrices: an embedding's (`embed` in its name) N(0,
    embedding_std); any other N(0, weight_std) when given (transformers' initializer_range), else torch's default for
    a linear layer, U(±1/sqrt(fan_in))."""
    for name, p in model.named_parameters():
        if p.ndim == 1:
            p.fill_(1.0 if name.endswith("weight") else 0.0)
            continue
        g = generator(seed, stream, name)
        if "embed" in name:
            p.normal_(0.0, embedding_std, generator=g)
        elif weight_std is not None:
            p.normal_(0.0, weight_std, generator=g)
        else:
            bound = 1.0 / math.sqrt(p.shape[1])
            p.uniform_(-bound, bound, generator=g)
