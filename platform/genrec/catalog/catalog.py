"""The item catalog: item IDs <-> semantic-ID codes (token IDs, 1..levels per item; codes may differ in length and
be shared), validated at load; and `ItemIndex`, a ranking model's item ID -> row of its item-embedding table.

A version genrec writes is named by its content hash, `catalog-<hash12>.parquet`, and checked against it whenever
hashed: a file changed after it was written is refused, never served under a version it is not. Columns, rules and
versions: docs/engine.md, 'Model directory' and 'New items without retraining: `genrec catalog add` / `retire`'.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from genrec.errors import CatalogError
from genrec.files import write_atomically

PAD = -1  # past the end of a shorter code in `Catalog.codes`
CATALOG_COLUMNS = ("item_id", "semantic_id", "popularity")  # every other column is an item attribute
_VERSIONED_NAME = re.compile(r"catalog-([0-9a-f]{12})\.parquet")


@dataclass
class Catalog:
    item_ids: np.ndarray  # [N] object (str)
    codes: np.ndarray  # [N, D] int64 token IDs, PAD past each item's length; D = the longest code
    lengths: np.ndarray = None  # [N] int64 tokens of each code (default: all D)
    popularity: np.ndarray | None = None  # [N] float64, or None: items sharing a code keep row order
    version: str = None  # its file's content hash (`catalog_version`); default: a hash of its items and codes
    attributes: pa.Table | None = None  # [N rows] the item attribute columns (every other column), or None
    _index: dict[str, int] = field(default=None, repr=False)

    def __post_init__(self):
        if self.lengths is None:
            self.lengths = np.full(len(self.codes), self.codes.shape[1], dtype=np.int64)
        if self._index is None:
            self._index = {item: i for i, item in enumerate(self.item_ids.tolist())}
        if self.version is None:
            self.version = self._content_version()

    def _content_version(self) -> str:
        """A catalog built in memory: a hash of its items, codes and popularity (a file's is its bytes')."""
        digest = hashlib.sha256("\0".join(self.item_ids.tolist()).encode())
        for part in (self.codes, self.lengths, self.popularity):
            if part is not None:
                digest.update(np.ascontiguousarray(part).tobytes())
        return digest.hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.item_ids)

    @property
    def levels(self) -> int:
        """The longest code's tokens."""
        return self.codes.shape[1]

    def code(self, index: int) -> list[int]:
        """Item `index`'s code: its token IDs, no padding."""
        return self.codes[index, : self.lengths[index]].tolist()

    def index_of(self, item_id: str) -> int | None:
        return self._index.get(item_id)

    @classmethod
    def load(cls, path: str | Path, layout=None, data: bytes | None = None) -> Catalog:
        """`layout`: the model's SidLayout (genrec.model.sid_layout), every code checked against it. `data`: the
        file's bytes when the caller has read them (`read_catalog_file`). Its version is the hash of the very bytes
        parsed: a file replaced meanwhile is never served under the other file's version."""
        path = Path(path)
        data = read_catalog_file(path) if data is None else data
        try:
            table = pq.read_table(pa.BufferReader(arrow_owned(data)))
            table.validate(full=True)  # text that is not UTF-8, say: refused here, not by each request that reads it
        except (pa.ArrowException, OSError) as err:
            raise CatalogError(path, f"not a readable Parquet file ({err})") from None
        for column in ("item_id", "semantic_id"):
            if column not in table.column_names:
                raise CatalogError(path, f"column {column!r} is missing (have {table.column_names})")
        item_ids = _item_ids(table, path)
        popularity = _popularity(table, item_ids, path) if "popularity" in table.column_names else None
        attributes = table.drop_columns([c for c in CATALOG_COLUMNS if c in table.column_names])
        catalog = cls.validated(item_ids, _codes(table, path), layout, path, popularity, attributes)
        catalog.version = version_of(data, path)
        return catalog

    @classmethod
    def validated(cls, item_ids, codes, layout=None, path="catalog", popularity=None, attributes=None) -> Catalog:
        """`codes`: an integer matrix [N, D] or rows of integers of 1..D tokens each; `attributes`: a table of the
        item attribute columns, row-aligned with the items (none of them named like a catalog column)."""
        if len(item_ids) == 0:
            raise CatalogError(path, "catalog has no items")
        if any(not isinstance(i, str) or not i for i in item_ids):
            raise CatalogError(path, "column 'item_id' must be a non-empty string on every row")
        code_array, lengths = codes if isinstance(codes, tuple) else _code_matrix(codes, item_ids, path)
        _check_unique(item_ids, path, "item_id")
        if layout is not None:
            layout.check_codes(code_array, lengths, item_ids, path)
            if not layout.has_ending:
                _check_no_proper_prefix(code_array, lengths, item_ids, path)
        pop = None if popularity is None else np.asarray(popularity, dtype=np.float64)
        _check_attributes(attributes, len(item_ids), path)
        attrs = attributes if attributes is not None and attributes.num_columns else None
        return cls(np.asarray(item_ids, dtype=object), code_array, lengths, pop, attributes=attrs)

    def save(self, path: Path) -> None:
        """Written atomically (genrec.files): a reader of `path` sees the old catalog or this one."""
        write_atomically(path, parquet_bytes(self.to_table()))

    def to_table(self) -> pa.Table:
        """The catalog file's table: item_id, semantic_id, popularity and the attributes, where it has them."""
        offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int32)
        tokens = pa.array(self.codes[self.codes != PAD].astype(np.int32))  # row-major: each code, then the next
        columns = {
            "item_id": pa.array(self.item_ids.tolist(), pa.string()),
            "semantic_id": pa.ListArray.from_arrays(pa.array(offsets), tokens),
        }
        if self.popularity is not None:
            columns["popularity"] = pa.array(self.popularity, pa.float64())
        for name in self.attributes.column_names if self.attributes is not None else ():
            columns[name] = self.attributes.column(name)
        return pa.table(columns)


def parquet_bytes(table: pa.Table) -> bytes:
    """The Parquet file of `table`, in memory (hashed before it is named, then written atomically)."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def bytes_version(data: bytes) -> str:
    """The `catalog_version` of a catalog file's bytes."""
    return hashlib.sha256(data).hexdigest()[:16]


def arrow_owned(data: bytes) -> pa.Buffer:
    """A copy of `data` in memory Arrow owns. Arrow may drop its last reference to the buffer it reads on one of its
    own threads, late; a buffer wrapping Python bytes then takes the GIL to free them, which aborts the process if
    the interpreter is exiting ("terminate called without an active exception", apache/arrow#34314)."""
    buffer = pa.allocate_buffer(len(data))
    with pa.FixedSizeBufferWriter(buffer) as writer:
        writer.write(data)
    return buffer


def read_catalog_file(path: Path) -> bytes:
    """A catalog file's bytes, read once (hashed and parsed from the same bytes); CatalogError if it is not a file."""
    if path.is_dir():
        raise CatalogError(path, "is a directory; the catalog must be one Parquet file")
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CatalogError(path, "catalog file is missing") from None
    except OSError as err:
        raise CatalogError(path, f"cannot be read ({err})") from None


def catalog_version(path: Path) -> str:
    """A catalog file's content hash, its `catalog_version`; CatalogError when its name carries another hash
    (`versioned_name`): it was changed after it was written."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return _checked_against_name(digest.hexdigest()[:16], path)


def version_of(data: bytes, path: Path) -> str:
    """`catalog_version` of a file's bytes already read."""
    return _checked_against_name(bytes_version(data), path)


def _checked_against_name(version: str, path: Path) -> str:
    named = named_hash(path)
    if named is not None and not version.startswith(named):
        raise CatalogError(
            path,
            f"its content hash is {version[:12]}, not the {named} its name carries: the file was changed after it was "
            "written (a catalog version is never rewritten; write a new one with `genrec catalog`)",
        )
    return version


def versioned_name(version: str) -> str:
    return f"catalog-{version[:12]}.parquet"


def named_hash(path: str | Path) -> str | None:
    """The hash a catalog file's name carries (12 hex, `versioned_name`); None when the name carries none."""
    match = _VERSIONED_NAME.fullmatch(Path(path).name)
    return match.group(1) if match else None


def _item_ids(table: pa.Table, path) -> np.ndarray:
    kind = table.schema.field("item_id").type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise CatalogError(path, f"column 'item_id' must hold strings, not {kind}")
    return np.array(table.column("item_id").to_pylist(), dtype=object)


def _popularity(table: pa.Table, item_ids, path) -> np.ndarray:
    kind = table.schema.field("popularity").type
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        raise CatalogError(path, f"column 'popularity' must hold numbers, not {kind}")
    values = table.column("popularity").to_numpy(zero_copy_only=False).astype(np.float64)  # nulls become NaN
    bad = np.flatnonzero(~np.isfinite(values))
    if len(bad):
        raise CatalogError(
            path, f"column 'popularity', item {item_ids[bad[0]]!r}: null or not finite ({len(bad)} rows affected)"
        )
    return values


def _codes(table: pa.Table, path) -> tuple[np.ndarray, np.ndarray]:
    """The semantic_id column (lists of integers, no nulls, none empty) as ([N, D] int64 PAD-filled, lengths [N])."""
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
    lengths = pc.list_value_length(column).to_numpy().astype(np.int64)
    if len(lengths) and lengths.min() == 0:
        raise CatalogError(path, f"column 'semantic_id' is empty on {int((lengths == 0).sum())} row(s)")
    try:
        flat = values.cast(pa.int64()).to_numpy()
    except pa.ArrowInvalid as err:
        raise CatalogError(path, f"column 'semantic_id' holds a token ID outside int64 ({err})") from None
    return padded_rows(flat, lengths), lengths


def padded_rows(flat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Rows of these lengths, concatenated in `flat`, as a PAD-filled [N, longest] matrix (one scatter)."""
    width = int(lengths.max()) if len(lengths) else 0
    if len(lengths) and lengths.min() == width:
        return flat.reshape(len(lengths), width)
    row = np.repeat(np.arange(len(lengths)), lengths)
    col = np.arange(len(flat)) - np.repeat(lengths.cumsum() - lengths, lengths)
    out = np.full((len(lengths), width), PAD, dtype=np.int64)
    out[row, col] = flat
    return out


def _code_matrix(codes, item_ids, path) -> tuple[np.ndarray, np.ndarray]:
    """([N, D] int64, lengths) from an integer matrix or rows of integers; never truncates floats."""
    if isinstance(codes, np.ndarray):
        if codes.ndim != 2 or codes.shape[1] == 0:
            raise CatalogError(path, f"column 'semantic_id' must be one code per item, got shape {codes.shape}")
        if codes.dtype.kind not in "iu":
            raise CatalogError(path, f"column 'semantic_id' must hold integer token IDs, not {codes.dtype}")
        return codes.astype(np.int64), np.full(len(codes), codes.shape[1], dtype=np.int64)
    rows = [np.asarray(c if c is not None else []) for c in codes]
    for i, row in enumerate(rows):
        if row.ndim != 1 or len(row) == 0:
            raise CatalogError(path, f"column 'semantic_id', item {item_ids[i]!r}: empty or not a list of token IDs")
        if row.dtype.kind not in "iu":
            raise CatalogError(
                path, f"column 'semantic_id', item {item_ids[i]!r}: must hold integer token IDs, not {row.dtype}"
            )
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    return padded_rows(np.concatenate(rows).astype(np.int64), lengths), lengths


def _check_attributes(attributes: pa.Table | None, items: int, path) -> None:
    if attributes is None:
        return
    if attributes.num_rows != items:
        raise CatalogError(path, f"the attribute columns have {attributes.num_rows} rows for {items} items")
    clash = [c for c in attributes.column_names if c in CATALOG_COLUMNS]
    if clash:
        raise CatalogError(path, f"attribute column {clash[0]!r} is named like a catalog column")


def _check_unique(values, path, name):
    uniq, counts = np.unique(np.asarray(values, dtype=object).astype(str), return_counts=True)
    dup = uniq[counts > 1]
    if len(dup):
        raise CatalogError(path, f"duplicate {name}s: {dup[:5].tolist()}{' ...' if len(dup) > 5 else ''}")


def _check_no_proper_prefix(codes: np.ndarray, lengths: np.ndarray, item_ids, path) -> None:
    """Without an ending token, a code that is a proper prefix of another cannot be told apart from it by the
    decode: refuse it, naming both items."""
    for k in np.unique(lengths[lengths < codes.shape[1]]).tolist():
        short = np.flatnonzero(lengths == k)
        longer = np.flatnonzero(lengths > k)
        both = np.concatenate([codes[short, :k], codes[longer, :k]])
        _, key = np.unique(both, axis=0, return_inverse=True)
        key = key.reshape(-1)
        hit = np.isin(key[: len(short)], key[len(short) :])
        if hit.any():
            row = short[np.argmax(hit)]
            other = longer[np.argmax(key[len(short) :] == key[np.argmax(hit)])]
            raise CatalogError(
                path,
                f"column 'semantic_id', item {item_ids[row]!r}: its code {codes[row, :k].tolist()} is a proper prefix "
                f"of item {item_ids[other]!r}'s code; that needs an ending token in the model's SID layout "
                f"(genrec/sid_layout.json 'ending'): {int(hit.sum())} codes affected",
            )


class ItemIndex:
    """A ranking model's catalog: item ID -> its embedding row."""

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
