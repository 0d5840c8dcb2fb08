"""The item catalog: item IDs <-> semantic-ID codes (token IDs, one per level), validated at load."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
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
        if not path.exists():
            raise CatalogError(path, "catalog file is missing")
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as err:
            raise CatalogError(path, f"not a readable Parquet file ({err})") from None
        for column in ("item_id", "semantic_id"):
            if column not in table.column_names:
                raise CatalogError(path, f"column {column!r} is missing (have {table.column_names})")
        item_ids = np.array(table.column("item_id").to_pylist(), dtype=object)
        codes = table.column("semantic_id").to_pylist()
        return cls.validated(item_ids, codes, level_ranges, path)

    @classmethod
    def validated(cls, item_ids, codes, level_ranges, path="catalog") -> Catalog:
        if len(item_ids) == 0:
            raise CatalogError(path, "catalog has no items")
        if any(not isinstance(i, str) or not i for i in item_ids):
            raise CatalogError(path, "item_id must be a non-empty string on every row")
        lengths = {len(c) if c is not None else 0 for c in codes}
        if len(lengths) != 1 or 0 in lengths:
            raise CatalogError(path, f"semantic_id lengths are ragged or empty (lengths seen: {sorted(lengths)})")
        code_array = np.asarray(codes, dtype=np.int64)
        _check_unique(item_ids, path, "item_id")
        _check_unique_rows(code_array, item_ids, path)
        if level_ranges is not None:
            _check_ranges(code_array, item_ids, level_ranges, path)
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
            path, f"codes have {codes.shape[1]} levels but the tokenizer defines {len(level_ranges)} levels"
        )
    for level, (lo, hi) in enumerate(level_ranges):
        bad = np.flatnonzero((codes[:, level] < lo) | (codes[:, level] > hi))
        if len(bad):
            row = bad[0]
            raise CatalogError(
                path,
                f"item {item_ids[row]!r}: token {codes[row, level]} at level {level} is outside that level's "
                f"range [{lo}, {hi}] ({len(bad)} rows affected)",
            )
