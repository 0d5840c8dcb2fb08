"""Read a checkpoint's tensors from `model.safetensors` or a sharded `model.safetensors.index.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from genrec.errors import ModelDirectoryError


def loaded_embedding(rows: int, width: int) -> torch.nn.Embedding:
    """An embedding whose weights a checkpoint fills, so none are drawn: on the meta device, where models are
    built, drawing them would import torch's compiler (seconds in every process that loads a model)."""
    return torch.nn.Embedding(rows, width, _weight=torch.empty(rows, width))


def weight_files(model_dir: Path) -> list[Path]:
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


@dataclass(frozen=True)
class TensorInfo:
    """What a checkpoint says of one tensor: its shape, its dtype and the file holding it."""

    shape: tuple[int, ...]
    dtype: str  # torch's name ("torch.float32"), or the file's for a type torch lacks ("F8_E8M0")
    floating: bool
    file: Path

    @classmethod
    def of(cls, tensor: torch.Tensor, file: Path) -> TensorInfo:
        return cls(tuple(tensor.shape), str(tensor.dtype), tensor.is_floating_point(), file)


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Every tensor's shape and dtype from the file's safetensors header, no tensor data read; the header must
    parse and cover the file exactly (a truncated or padded copy is refused)."""
    if not file.is_file():
        raise ModelDirectoryError(file, "weight shard is missing")
    try:
        with safe_open(str(file), "pt") as tensors:
            slices = ((name, tensors.get_slice(name)) for name in tensors.keys())
            return {name: _info(s.get_shape(), s.get_dtype(), file) for name, s in slices}
    except (SafetensorError, OSError) as err:
        raise ModelDirectoryError(
            file, f"not a complete safetensors file ({file.stat().st_size} bytes: {err})"
        ) from None


def read_headers(files: list[Path]) -> dict[str, TensorInfo]:
    """The tensors of all the checkpoint's files (a name in two shards: the later file's, as loading does)."""
    found: dict[str, TensorInfo] = {}
    for file in files:
        found.update(read_header(file))
    return found


def _info(shape: list[int], name: str, file: Path) -> TensorInfo:
    dtype = getattr(torch, SAFETENSORS_DTYPES.get(name, ""), None)
    if isinstance(dtype, torch.dtype):
        return TensorInfo(tuple(shape), str(dtype), dtype.is_floating_point, file)
    return TensorInfo(tuple(shape), name, name.startswith(("F", "BF")), file)  # a float type torch lacks, or not


SAFETENSORS_DTYPES = {  # the header's dtype names -> torch's (those torch has)
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64",
    "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool", "C64": "complex64",
}  # fmt: skip


@dataclass(frozen=True)
class Layout:
    """The checkpoint tensors a model's config implies: each parameter's name and shape. `tied`: a parameter the
    checkpoint may leave out, taken from another tensor; `closed`: a tensor that is no parameter is refused too.
    `match` is the one rule the deploy's preflight (on the headers) and loading (on the tensors) both apply."""

    shapes: dict[str, tuple[int, ...]]
    tied: dict[str, str] = field(default_factory=dict)
    closed: bool = False

    @classmethod
    def of(cls, model: torch.nn.Module, tied: dict[str, str] | None = None, closed: bool = False) -> Layout:
        """The layout of `model` (built on the meta device: shapes without memory)."""
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        return cls(shapes, tied or {}, closed)

    def match(self, found: dict[str, TensorInfo], model_dir: Path) -> dict[str, str]:
        """The tensor each parameter takes (its own, or the one it is tied to), each present, floating point and of
        the implied shape; with `closed`, no other tensor. Else a ModelDirectoryError naming the first problem."""
        source = {name: self.tied[name] if name not in found and name in self.tied else name for name in self.shapes}
        missing = sorted(name for name, src in source.items() if src not in found)
        if missing:
            files = ", ".join(sorted({info.file.name for info in found.values()})) or "no tensors"
            raise ModelDirectoryError(
                model_dir, f"weights ({files}) lack {len(missing)} tensors config.json implies, e.g. {missing[:3]}"
            )
        extra = sorted(set(found) - set(self.shapes)) if self.closed else []
        if extra:
            raise ModelDirectoryError(
                found[extra[0]].file,
                f"weights hold {len(extra)} tensors config.json does not imply, e.g. {extra[:3]}",
            )
        for name, src in source.items():
            info, implied = found[src], self.shapes[name]
            if not info.floating or info.shape != implied:
                tied = f" (for {name}, tied to it)" if src != name else ""
                raise ModelDirectoryError(
                    info.file,
                    f"tensor {src} has shape {list(info.shape)} and dtype {info.dtype} in this file; config.json "
                    f"implies shape {list(implied)} and a floating point dtype{tied}",
                )
        return source


def model_weight(name: str, tensor: torch.Tensor, device, dtype: torch.dtype, model_dir: Path) -> torch.Tensor:
    """One checkpoint tensor in the model's dtype on its device. Values that are not finite in the model's dtype
    are refused: they would load fine and serve NaN scores."""
    weight = tensor.to(device=device, dtype=dtype)
    # min and max are finite iff every value is (NaN propagates): one reduction, ~20x cheaper than isfinite().all().
    if weight.numel() and not torch.isfinite(torch.stack(torch.aminmax(weight))).all():
        raise ModelDirectoryError(model_dir, f"tensor {name} holds NaN or infinite values (as {dtype})")
    return weight


def assign_weights(model, layout: Layout, tensors: dict, model_dir: Path, device, dtype) -> None:
    """Load `tensors` into `model` (built on the meta device), matched against `layout` and checked finite."""
    source = layout.match({name: TensorInfo.of(t, model_dir) for name, t in tensors.items()}, model_dir)
    state = {name: model_weight(src, tensors[src], device, dtype, model_dir) for name, src in source.items()}
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
