"""Read a checkpoint's tensors from `model.safetensors` or a sharded `model.safetensors.index.json`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from genrec.errors import ModelDirectoryError


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.exists():
        return _read(single)
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as err:
            raise ModelDirectoryError(index, f"not a valid safetensors index ({err})") from None
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            tensors.update(_read(model_dir / shard))
        return tensors
    raise ModelDirectoryError(model_dir, "no model.safetensors (nor model.safetensors.index.json) in the directory")


def _read(path: Path) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise ModelDirectoryError(path, "weight shard is missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise ModelDirectoryError(path, f"cannot read safetensors file ({err})") from None
