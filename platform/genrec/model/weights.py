"""Read a checkpoint's tensors from `model.safetensors` or a sharded `model.safetensors.index.json`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from genrec.errors import ModelDirectoryError


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: `model.safetensors`, or the shards a `model.safetensors.index.json` names."""
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.exists():
        return [single]
    if index.exists():
        return [model_dir / shard for shard in _shards(index)]
    raise ModelDirectoryError(model_dir, "no model.safetensors (nor model.safetensors.index.json) in the directory")


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(model_dir):
        tensors.update(_read(file))
    return tensors


def check_weight_file(file: Path) -> None:
    """The file's safetensors header parses and covers the file exactly (a truncated or padded copy fails here),
    without reading the tensors."""
    if not file.is_file():
        raise ModelDirectoryError(file, "weight shard is missing")
    try:
        with safe_open(str(file), "pt"):
            pass
    except (SafetensorError, OSError) as err:
        raise ModelDirectoryError(
            file, f"not a complete safetensors file ({file.stat().st_size} bytes: {err})"
        ) from None


def model_weight(name: str, tensor: torch.Tensor, device, dtype: torch.dtype, model_dir: Path) -> torch.Tensor:
    """One checkpoint tensor in the model's dtype on its device. Integer or bool tensors, and values that are
    not finite in the model's dtype, are refused: they would load fine and serve NaN scores."""
    if not tensor.is_floating_point():
        raise ModelDirectoryError(model_dir, f"tensor {name} has dtype {tensor.dtype}; weights must be floating point")
    weight = tensor.to(device=device, dtype=dtype)
    # min and max are finite iff every value is (NaN propagates): one reduction, ~20x cheaper than isfinite().all().
    if weight.numel() and not torch.isfinite(torch.stack(torch.aminmax(weight))).all():
        raise ModelDirectoryError(model_dir, f"tensor {name} holds NaN or infinite values (as {dtype})")
    return weight


def assign_weights(model, tensors: dict, model_dir: Path, device, dtype, refuse_extra: bool = False) -> None:
    """Load `tensors` into `model` (built on the meta device), each checked by name and shape against its
    parameters, and finite; `refuse_extra`: a tensor the model has no parameter for is an error too."""
    expected = {name: p.shape for name, p in model.named_parameters()}
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ModelDirectoryError(model_dir, f"weights lack {len(missing)} tensors, e.g. {missing[:3]}")
    extra = sorted(set(tensors) - set(expected)) if refuse_extra else []
    if extra:
        raise ModelDirectoryError(
            model_dir, f"weights hold {len(extra)} tensors the config does not imply, e.g. {extra[:3]}"
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise ModelDirectoryError(
                model_dir, f"tensor {name} has shape {tuple(tensors[name].shape)}, config implies {tuple(shape)}"
            )
    state = {n: model_weight(n, tensors[n], device, dtype, model_dir) for n in expected}
    model.load_state_dict(state, strict=True, assign=True)


def _shards(index: Path) -> list[str]:
    """The index's shard file names. Each must be a relative path that stays inside the model directory.
    (Symbolic links are followed: the Hugging Face cache links every file to a blob outside the snapshot.)"""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = set(weight_map.values())
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise ModelDirectoryError(index, f"not a valid safetensors index ({type(err).__name__}: {err})") from None
    for name in names:
        if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
            raise ModelDirectoryError(
                index, f"weight_map names {name!r}: a shard must be a relative path inside the model directory"
            )
    return sorted(names)


def _read(path: Path) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise ModelDirectoryError(path, "weight shard is missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise ModelDirectoryError(path, f"cannot read safetensors file ({err})") from None
