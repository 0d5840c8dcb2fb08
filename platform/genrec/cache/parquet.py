"""Bulk load of `user_id, embedding` rows from Parquet into a store, checked batch by batch with Arrow. The load
stops at the first bad batch, naming the file, column and row; the batches before it are stored (a rerun rewrites
the same values under the same keys).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from genrec.cache.keys import normalize_keys
from genrec.errors import CacheError


def load_parquet(path: str | Path, store, batch_rows: int = 65536) -> int:
    """Load every row into `store` (anything with `dim` and `put_many`); returns the rows loaded."""
    try:
        parquet = pq.ParquetFile(str(path))
    except (OSError, pa.ArrowException) as e:
        raise CacheError(f"{path}: not a readable Parquet file ({e})") from None
    _check_schema(path, parquet.schema_arrow, store.dim)
    loaded = 0
    for batch in parquet.iter_batches(batch_size=batch_rows, columns=["user_id", "embedding"]):
        ids = batch.column("user_id")
        _refuse_nulls(path, "user_id", ids, loaded)
        vectors = _embeddings(path, batch.column("embedding"), store.dim, loaded)
        store.put_many(normalize_keys(ids), vectors)
        loaded += batch.num_rows
    return loaded


def _check_schema(path, schema: pa.Schema, dim: int) -> None:
    for column in ("user_id", "embedding"):
        if column not in schema.names:
            raise CacheError(f"{path}: column {column!r} is missing (have {schema.names})")
    ids = schema.field("user_id").type
    if pa.types.is_dictionary(ids):
        ids = ids.value_type
    if not (pa.types.is_integer(ids) or pa.types.is_string(ids) or pa.types.is_large_string(ids)):
        raise CacheError(f"{path}: column 'user_id' must hold integers or strings, got {ids}")
    embedding = schema.field("embedding").type
    is_list = pa.types.is_list(embedding) or pa.types.is_large_list(embedding) or pa.types.is_fixed_size_list(embedding)
    if not is_list or not (pa.types.is_floating(embedding.value_type) or pa.types.is_integer(embedding.value_type)):
        raise CacheError(f"{path}: column 'embedding' must be a list of floats, got {embedding}")
    if pa.types.is_fixed_size_list(embedding) and embedding.list_size != dim:
        raise CacheError(f"{path}: column 'embedding' holds {embedding.list_size} values a row; the store wants {dim}")


def _refuse_nulls(path, column: str, values: pa.Array, first_row: int) -> None:
    if values.null_count:
        row = first_row + int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        raise CacheError(f"{path}: {values.null_count} rows have a null {column!r} (the first: row {row})")


def _embeddings(path, column: pa.Array, dim: int, first_row: int) -> np.ndarray:
    """The column as float32 [rows, dim]: row lengths checked from the list offsets, values finite."""
    _refuse_nulls(path, "embedding", column, first_row)
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    ragged = np.flatnonzero(lengths != dim)
    if ragged.size:
        row = ragged[0]
        raise CacheError(
            f"{path}: row {first_row + row} has an embedding of {lengths[row]} values; every embedding must have"
            f" {dim} values ({ragged.size} rows of this batch differ)"
        )
    with np.errstate(over="ignore"):  # values beyond float32 become inf: refused below
        vectors = column.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(len(column), dim)
    bad = np.flatnonzero(~np.isfinite(vectors).all(axis=1))
    if bad.size:
        raise CacheError(f"{path}: row {first_row + bad[0]} has a non-finite (NaN, infinite or null) embedding value")
    return vectors
