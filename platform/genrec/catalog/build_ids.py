"""Semantic IDs from item embeddings: residual k-means per level, plus a last level that makes codes unique."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from genrec.catalog.catalog import Catalog
from genrec.errors import GenrecError


def kmeans(x: torch.Tensor, k: int, iters: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain Lloyd's k-means: (centers [k, dim], assignment [n]). Empty clusters keep their center."""
    k = min(k, len(x))
    centers = x[torch.randperm(len(x), generator=generator)[:k]].clone()
    assign = torch.zeros(len(x), dtype=torch.int64)
    for _ in range(iters):
        assign = torch.cdist(x, centers).argmin(dim=1)
        sums = torch.zeros_like(centers).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=k)
        filled = counts > 0
        centers[filled] = sums[filled] / counts[filled, None]
    return centers, assign


def residual_codes(embeddings: np.ndarray, codebooks: list[int], last_size: int, iters=20, seed=0) -> np.ndarray:
    """Codes [n, len(codebooks)+1]: residual k-means levels, then a rank among items with the same prefix."""
    x = torch.as_tensor(embeddings, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    residual = x.clone()
    columns = []
    for k in codebooks:
        centers, assign = kmeans(residual, k, iters, generator)
        residual = residual - centers[assign]
        columns.append(assign.numpy())
    prefix = np.stack(columns, axis=1) if columns else np.zeros((len(x), 0), dtype=np.int64)
    _, group = np.unique(prefix, axis=0, return_inverse=True)
    group = group.reshape(-1)
    order = np.argsort(group, kind="stable")
    sorted_group = group[order]
    starts = np.searchsorted(sorted_group, sorted_group, side="left")
    rank = np.empty(len(x), dtype=np.int64)
    rank[order] = np.arange(len(x)) - starts
    if rank.max() >= last_size:
        raise GenrecError(
            f"{int(rank.max()) + 1} items share one code prefix but the last level has only {last_size} tokens: "
            "use a model with more levels or a larger codebook"
        )
    return np.concatenate([prefix, rank[:, None]], axis=1)


def build_catalog(embeddings_path: Path, level_ranges: list[tuple[int, int]], iters=20, seed=0) -> Catalog:
    if not Path(embeddings_path).is_file():
        raise GenrecError(f"{embeddings_path}: no such file (expected Parquet with item_id, embedding)")
    table = pq.read_table(embeddings_path)
    for column in ("item_id", "embedding"):
        if column not in table.column_names:
            raise GenrecError(f"{embeddings_path}: column {column!r} is missing (have {table.column_names})")
    item_ids = np.array(table.column("item_id").to_pylist(), dtype=object)
    vectors = table.column("embedding").to_pylist()
    if len({len(v) for v in vectors}) != 1:
        raise GenrecError(f"{embeddings_path}: embeddings have different lengths")
    sizes = [hi - lo + 1 for lo, hi in level_ranges]
    codes = residual_codes(np.asarray(vectors, dtype=np.float32), sizes[:-1], sizes[-1], iters, seed)
    token_ids = codes + np.array([lo for lo, _ in level_ranges])
    return Catalog.validated(item_ids, token_ids, level_ranges, embeddings_path)
