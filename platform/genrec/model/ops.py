"""What a model's forward passes run: the elementwise pieces between its matrix products (`fused.Pieces`, plain or
compiled) and the attention kernels (`genrec.attention.kernels`). An execution plan (genrec.engine.plan) chooses
them once per engine; the model code takes them and never asks which device it is on."""

from __future__ import annotations

from dataclasses import dataclass

from genrec.attention.kernels import REFERENCE, AttentionKernels
from genrec.model.fused import PLAIN, Pieces


@dataclass(frozen=True)
class ModelOps:
    pieces: Pieces = PLAIN
    attention: AttentionKernels = REFERENCE


PLAIN_OPS = ModelOps()  # the reference: plain torch on any device
