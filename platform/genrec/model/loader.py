"""Build our `Qwen3` module from a Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path

import torch

from genrec.errors import ModelDirectoryError
from genrec.model.config import Qwen3Config
from genrec.model.qwen3 import Qwen3, Rotary
from genrec.model.weights import load_state_dict, model_weight


def load_qwen3(model_dir: Path, device="cpu", dtype: torch.dtype = torch.float32) -> Qwen3:
    config = Qwen3Config.from_file(model_dir / "config.json")
    tensors = load_state_dict(model_dir)
    if "lm_head.weight" not in tensors and config.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors.get("model.embed_tokens.weight")
    with torch.device("meta"):
        model = Qwen3(config)
    expected = {name: p.shape for name, p in model.named_parameters()}
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ModelDirectoryError(model_dir, f"weights lack {len(missing)} tensors, e.g. {missing[:3]}")
    wrong = [n for n, shape in expected.items() if tuple(tensors[n].shape) != tuple(shape)]
    if wrong:
        n = wrong[0]
        raise ModelDirectoryError(
            model_dir, f"tensor {n} has shape {tuple(tensors[n].shape)}, config implies {tuple(expected[n])}"
        )
    state = {n: model_weight(n, tensors[n], device, dtype, model_dir) for n in expected}
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = Rotary(config.head_dim, config.rope_theta).to(device)
    return model.eval().requires_grad_(False).fuse()
