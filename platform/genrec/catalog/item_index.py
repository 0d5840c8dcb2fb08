"""A ranking model's catalog: item ID -> its row of the model's item-embedding table (`genrec/catalog.parquet`
with columns item_id, item_index), validated at load."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from genrec.catalog.catalog import catalog_version
from genrec.errors import CatalogError


class ItemIndex:
    def __init__(self, item_ids: list[str], rows: np.ndarray, version: str | None = None):
        self.item_ids = np.asarray(item_ids, dtype=object)
        self.rows = rows  # [N] int64: each item's embedding row
        self.version = version  # its file's content hash (catalog.catalog_version); None: built in memory
        self._index = {item: i for i, item in enumerate(item_ids)}

    def __len__(self) -> int:
        return len(self.item_ids)

    def row_of(self, item_id: str) -> int | None:
        """The item's embedding row, or None for an item outside the catalog."""
        i = self._index.get(item_id)
        return None if i is None else int(self.rows[i])

    @classmethod
    def load(cls, path: Path, table_rows: int) -> ItemIndex:
        if not path.is_file():
            raise CatalogError(path, "is missing or not a file; the catalog must be one Parquet file")
        try:
            table = pq.read_table(path)
        except Exception as err:  # noqa: BLE001 - any unreadable file is the same operator error
            raise CatalogError(path, f"is not a readable Parquet file ({err})") from None
        for column in ("item_id", "item_index"):
            if column not in table.column_names:
                raise CatalogError(path, f"has no {column!r} column")
        item_ids = table.column("item_id").to_pylist()
        rows = np.asarray(table.column("item_index").to_pylist(), dtype=np.int64)
        if any(not isinstance(i, str) or not i for i in item_ids):
            raise CatalogError(path, "every item_id must be a non-empty string")
        if len(set(item_ids)) != len(item_ids):
            raise CatalogError(path, "item_id values repeat")
        if len(rows) and (rows.min() < 0 or rows.max() >= table_rows):
            raise CatalogError(path, f"item_index values must lie in 0..{table_rows - 1} (the model's item table)")
        return cls(item_ids, rows, catalog_version(path))
