"""Build our `Qwen3` module from a Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path

import torch

from genrec.model.config import Qwen3Config
from genrec.model.qwen3 import Qwen3, Rotary
from genrec.model.weights import assign_weights, load_state_dict


def load_qwen3(model_dir: Path, device="cpu", dtype: torch.dtype = torch.float32) -> Qwen3:
    config = Qwen3Config.from_file(model_dir / "config.json")
    tensors = load_state_dict(model_dir)
    if "lm_head.weight" not in tensors and config.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors.get("model.embed_tokens.weight")
    with torch.device("meta"):
        model = Qwen3(config)
    assign_weights(model, tensors, model_dir, device, dtype)
    model.rotary = Rotary(config.head_dim, config.rope_theta).to(device)
    return model.eval().requires_grad_(False).fuse()
