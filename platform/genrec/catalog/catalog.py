"""The item catalog: item IDs <-> semantic-ID codes (token IDs, one per level), validated at load."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from genrec.errors import CatalogError


@dataclass
class Catalog:
    item_ids: np.ndarray  # [N] object (str)
    codes: np.ndarray  # [N, D] int64 token IDs
    _index: dict[str, int] = field(default=None, repr=False)

    def __post_init__(self):
        if self._index is None:
            self._index = {item: i for i, item in enumerate(self.item_ids.tolist())}

    def __len__(self) -> int:
        return len(self.item_ids)

    @property
    def levels(self) -> int:
        return self.codes.shape[1]

    def index_of(self, item_id: str) -> int | None:
        return self._index.get(item_id)

    @classmethod
    def load(cls, path: Path, level_ranges: list[tuple[int, int]] | None = None) -> Catalog:
        if path.is_dir():
            raise CatalogError(path, "is a directory; the catalog must be one Parquet file")
        if not path.exists():
            raise CatalogError(path, "catalog file is missing")
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as err:
            raise CatalogError(path, f"not a readable Parquet file ({err})") from None
        for column in ("item_id", "semantic_id"):
            if column not in table.column_names:
                raise CatalogError(path, f"column {column!r} is missing (have {table.column_names})")
        return cls.validated(_item_ids(table, path), _codes(table, path), level_ranges, path)

    @classmethod
    def validated(cls, item_ids, codes, level_ranges, path="catalog") -> Catalog:
        if len(item_ids) == 0:
            raise CatalogError(path, "catalog has no items")
        if any(not isinstance(i, str) or not i for i in item_ids):
            raise CatalogError(path, "column 'item_id' must be a non-empty string on every row")
        code_array = _code_matrix(codes, path)
        _check_unique(item_ids, path, "item_id")
        if level_ranges is not None:  # before uniqueness: codes cut short look like duplicates
            _check_ranges(code_array, item_ids, level_ranges, path)
        _check_unique_rows(code_array, item_ids, path)
        return cls(np.asarray(item_ids, dtype=object), code_array)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        table = pa.table(
            {
                "item_id": pa.array(self.item_ids.tolist(), pa.string()),
                "semantic_id": pa.array(self.codes.tolist(), pa.list_(pa.int32())),
            }
        )
        pq.write_table(table, path)


def _item_ids(table: pa.Table, path) -> np.ndarray:
    kind = table.schema.field("item_id").type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise CatalogError(path, f"column 'item_id' must hold strings, not {kind}")
    return np.array(table.column("item_id").to_pylist(), dtype=object)


def _codes(table: pa.Table, path) -> np.ndarray:
    """The semantic_id column as [N, D] int64, read by its Arrow type: lists of integers, no nulls."""
    kind = table.schema.field("semantic_id").type
    is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    if not is_list or not pa.types.is_integer(kind.value_type):
        raise CatalogError(path, f"column 'semantic_id' must be a list of integer token IDs, not {kind}")
    column = table.column("semantic_id").combine_chunks()
    if column.null_count:
        raise CatalogError(path, f"column 'semantic_id' is null on {column.null_count} row(s)")
    values = column.flatten()
    if values.null_count:
        raise CatalogError(path, f"column 'semantic_id' has {values.null_count} null token ID(s)")
    lengths = pc.list_value_length(column).to_numpy()
    if len(lengths) and (lengths.min() != lengths.max() or lengths.min() == 0):
        raise _ragged(path, lengths)
    try:
        flat = values.cast(pa.int64()).to_numpy()
    except pa.ArrowInvalid as err:
        raise CatalogError(path, f"column 'semantic_id' holds a token ID outside int64 ({err})") from None
    return flat.reshape(len(lengths), int(lengths[0]) if len(lengths) else 0)


def _code_matrix(codes, path) -> np.ndarray:
    """[N, D] int64 from an integer matrix or equal-length rows of integers; never truncates floats."""
    if not isinstance(codes, np.ndarray):
        lengths = [len(c) if c is not None else 0 for c in codes]
        if len(set(lengths)) != 1 or 0 in lengths:
            raise _ragged(path, lengths)
        codes = np.asarray(codes)
    if codes.ndim != 2 or codes.shape[1] == 0:
        raise CatalogError(path, f"column 'semantic_id' must be one code per item, got shape {codes.shape}")
    if codes.dtype.kind not in "iu":
        raise CatalogError(path, f"column 'semantic_id' must hold integer token IDs, not {codes.dtype}")
    return codes.astype(np.int64)


def _ragged(path, lengths) -> CatalogError:
    seen = sorted(set(np.asarray(lengths).tolist()))
    return CatalogError(path, f"column 'semantic_id' lengths are ragged or empty (lengths seen: {seen[:10]})")


def _check_unique(values, path, name):
    uniq, counts = np.unique(np.asarray(values, dtype=object).astype(str), return_counts=True)
    dup = uniq[counts > 1]
    if len(dup):
        raise CatalogError(path, f"duplicate {name}s: {dup[:5].tolist()}{' ...' if len(dup) > 5 else ''}")


def _check_unique_rows(codes, item_ids, path):
    _, first, counts = np.unique(codes, axis=0, return_index=True, return_counts=True)
    if (counts > 1).any():
        row = first[np.argmax(counts > 1)]
        raise CatalogError(path, f"duplicate semantic_id {codes[row].tolist()} (first on item {item_ids[row]!r})")


def _check_ranges(codes, item_ids, level_ranges, path):
    if codes.shape[1] != len(level_ranges):
        raise CatalogError(
            path,
            f"column 'semantic_id' has codes of {codes.shape[1]} levels but the tokenizer defines "
            f"{len(level_ranges)} levels",
        )
    for level, (lo, hi) in enumerate(level_ranges):
        bad = np.flatnonzero((codes[:, level] < lo) | (codes[:, level] > hi))
        if len(bad):
            row = bad[0]
            raise CatalogError(
                path,
                f"column 'semantic_id', item {item_ids[row]!r}: token {codes[row, level]} at level {level} is "
                f"outside that level's range [{lo}, {hi}] ({len(bad)} rows affected)",
            )
