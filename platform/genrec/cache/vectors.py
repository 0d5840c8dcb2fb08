"""The one check every writer runs (table, stores, the sharded client) before anything is written."""

from __future__ import annotations

import numpy as np

from genrec.cache.keys import normalize_keys
from genrec.errors import CacheError


def check_dim(dim) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim <= 0:
        raise CacheError(f"dim must be a positive integer, got {dim!r}")
    return int(dim)


def as_vectors(vectors, rows: int, dim: int) -> np.ndarray:
    """vectors -> float32 [rows, dim], C-contiguous and finite; CacheError otherwise."""
    try:
        raw = np.asarray(vectors)
    except (TypeError, ValueError) as e:  # ragged nested lists
        raise CacheError(f"vectors must be a numeric [n, dim] array: {e}") from None
    if raw.dtype.kind not in "fiu":
        raise CacheError(f"vectors must be numeric, got dtype {raw.dtype}")
    if rows == 0 and raw.shape in ((0,), (0, dim)):
        return np.zeros((0, dim), dtype=np.float32)
    if raw.shape != (rows, dim):
        raise CacheError(f"vectors must have shape ({rows}, {dim}) (one row per ID), got {raw.shape}")
    with np.errstate(over="ignore"):  # float64 beyond float32's range becomes inf: refused below
        matrix = np.ascontiguousarray(raw, dtype=np.float32)
    if not np.isfinite(matrix).all():
        raise CacheError("vectors contain non-finite values (NaN or infinity, or beyond float32's range)")
    return matrix


def checked_batch(ids, vectors, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(int64 keys [n], float32 vectors [n, dim]) for a write of `vectors` under `ids`."""
    keys = normalize_keys(ids)
    return keys, as_vectors(vectors, len(keys), dim)
