"""Write complete, deterministic HSTU model directories with random weights (no model hub is reachable).

Layout, like the Qwen3 one: config.json (model_type genrec_hstu), model.safetensors, and
genrec/catalog.parquet mapping each item ID (string column `item_id`) to its row of the item embedding table
(int64 column `item_index`). Weights are drawn so that hidden states stay O(1) through the layers and the
task probabilities spread over (0, 1): tests are not decided by saturated sigmoids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from genrec.model.directory import GENREC_SUBDIR
from genrec.model.hstu import HSTU
from genrec.model.hstu_config import HSTUConfig


@dataclass(frozen=True)
class HSTUSpec:
    items: int = 500
    hidden: int = 64
    layers: int = 2
    heads: int = 2
    head_dim: int = 16
    max_positions: int = 4096
    normalizer: float | None = None  # None: max_positions (the longest sequence the model was sized for)
    actions: int = 4
    time_buckets: int = 16
    tasks: tuple[str, ...] = ("click", "like", "long_view")
    head_hidden: int = 64
    seed: int = 0

    def config(self) -> HSTUConfig:
        """The config this spec writes (raises ValueError for an impossible spec)."""
        return HSTUConfig(
            num_items=self.items,
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            head_dim=self.head_dim,
            attention_normalizer=float(self.normalizer or self.max_positions),
            max_positions=self.max_positions,
            num_actions=self.actions,
            tasks=tuple(self.tasks),
            head_hidden=self.head_hidden,
            num_time_buckets=self.time_buckets,
        )


PRESETS = {
    # The CPU benchmark shape (DLRMv3-like, scaled down): model dim 256, 4 layers, 4 heads, head dim 64.
    "tiny": HSTUSpec(items=2000, hidden=256, layers=4, heads=4, head_dim=64, head_hidden=256),
}


def preset(name: str, **overrides) -> HSTUSpec:
    if name not in PRESETS:
        raise ValueError(f"unknown HSTU preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def random_hstu(config: HSTUConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> HSTU:
    """An HSTU with deterministic random weights (every parameter drawn, LayerNorms included, so a test that
    reads the parameters by name cannot pass on default ones)."""
    generator = torch.Generator().manual_seed(seed)

    def normal(p: torch.Tensor, std: float, mean: float = 0.0) -> None:
        p.copy_(mean + std * torch.randn(p.shape, generator=generator))

    model = HSTU(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            kind = name.rsplit(".", 1)[-1]
            if name.startswith("item_embedding"):
                normal(p, 1.0)
            elif "embedding" in name:
                normal(p, 0.5)
            elif "norm" in name:  # LayerNorm scale near 1, shift near 0
                normal(p, 0.1, mean=1.0 if kind == "weight" else 0.0)
            elif kind == "bias":
                normal(p, 0.1)
            else:  # a Linear: unit gain; the head's logits a little wider (std ~2)
                normal(p, (2.0 if name == "head.out.weight" else 1.0) / math.sqrt(p.shape[1]))
    return model.to(dtype).eval().requires_grad_(False)


def write_catalog(path: Path, item_ids: list[str], indices: list[int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"item_id": pa.array(item_ids, pa.string()), "item_index": pa.array(indices, pa.int64())})
    pq.write_table(table, path)


def write_hstu_dir(out: str | Path, spec: HSTUSpec = HSTUSpec(), dtype: torch.dtype = torch.float32) -> Path:
    """Write the directory (created if needed; existing files are overwritten). Deterministic per spec."""
    out = Path(out)
    random_hstu(spec.config(), spec.seed).save(out, dtype=dtype)
    item_ids = [f"item-{i:06d}" for i in range(spec.items)]
    write_catalog(out / GENREC_SUBDIR / "catalog.parquet", item_ids, list(range(spec.items)))
    return out
