"""The users input and its shards: fixed row ranges of the Parquet file(s), numbered in a stable order (one engine
call and one output file each), so a rerun names every shard as the first run did. The driver finds repeated
user_ids over the whole input before any shard runs and gives each shard its own, so shards that run apart, in any
order, in any run, refuse the same rows (docs/batch.md, "One row per user").
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from genrec.errors import GenrecError


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) of a local path (relative to the current directory) or a URI (s3://...)."""
    if "://" not in uri:
        uri = str(Path(uri).expanduser().resolve())
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
        raise GenrecError(f"{uri}: not a usable path or filesystem URI ({err})") from None


@dataclass(frozen=True)
class InputLayout:
    """The columns a job reads besides `user_id`: for each entry of `required` one of its columns at least
    (e.g. a prompt as text or as token IDs), and whichever of `optional` the input has."""

    required: tuple[tuple[str, ...], ...]
    optional: tuple[str, ...] = ()

    def missing(self, names: list[str]) -> tuple[str, ...] | None:
        """The first requirement none of `names` meets."""
        return next((group for group in self.required if not any(c in names for c in group)), None)

    def columns(self, names: list[str]) -> list[str]:
        """The columns to read, of those the input has."""
        wanted = ("user_id", *(c for group in self.required for c in group), *self.optional)
        return [c for c in wanted if c in names]


@dataclass(frozen=True)
class Repeat:
    position: int  # row in the shard
    reason: str  # "repeats row N" (the user's row; "of FILE" when another file holds it)


@dataclass(frozen=True)
class Shard:
    index: int
    path: str  # inside the input's filesystem
    start: int  # first row in that file
    stop: int
    repeats: tuple[Repeat, ...] = ()  # its rows whose user_id an earlier row of the input has

    @property
    def name(self) -> str:
        return f"part-{self.index:06d}.parquet"

    @property
    def rows(self) -> int:
        return self.stop - self.start

    def as_row(self) -> dict:
        return asdict(self)

    @classmethod
    def from_row(cls, row: dict) -> Shard:
        return cls(**{**row, "repeats": tuple(Repeat(**r) for r in row.get("repeats") or ())})


SHARD_SCHEMA = pa.schema(
    [
        ("index", pa.int64()),
        ("path", pa.string()),
        ("start", pa.int64()),
        ("stop", pa.int64()),
        ("repeats", pa.list_(pa.struct([("position", pa.int64()), ("reason", pa.string())]))),
    ]
)


def shards_table(shards: list[Shard]) -> pa.Table:
    return pa.Table.from_pylist([s.as_row() for s in shards], SHARD_SCHEMA)


@dataclass(frozen=True)
class InputFile:
    path: str
    rows: int
    row_group_starts: tuple[int, ...]
    footer: str  # digest of size and Parquet footer: changes when the file does


class UsersInput:
    """A Parquet file or a directory of them (read in sorted name order) with one row per user."""

    def __init__(self, uri: str, layout: InputLayout):
        self.uri, self.layout = uri, layout
        self.fs, root = filesystem(uri)
        self.root = root
        info = self.fs.get_file_info(root)
        if info.type == pafs.FileType.NotFound:
            raise GenrecError(f"{uri}: no such file or directory (expected the users Parquet)")
        paths = [root] if info.type == pafs.FileType.File else _parquet_files(self.fs, root)
        if not paths:
            raise GenrecError(f"{uri}: no .parquet files in this directory")
        self.files = [self._describe(path) for path in paths]
        self.names: list[str] = []  # the input's columns
        self.columns = self._check_schema()  # those the job reads
        self._read: tuple[tuple, pa.Table] | None = None  # the row groups `read` read last

    def _describe(self, path: str) -> InputFile:
        try:
            with self.fs.open_input_file(path) as handle:
                size = handle.size()
                meta = pq.ParquetFile(handle).metadata
        except (OSError, pa.ArrowException) as err:
            raise GenrecError(f"{path}: not a readable Parquet file ({err})") from None
        starts, offset = [], 0
        for i in range(meta.num_row_groups):
            starts.append(offset)
            offset += meta.row_group(i).num_rows
        text = json.dumps([size, meta.to_dict()], sort_keys=True, default=str)
        return InputFile(path, meta.num_rows, tuple(starts), hashlib.sha256(text.encode()).hexdigest())

    def _check_schema(self) -> list[str]:
        schemas = []
        for file in self.files:
            with self.fs.open_input_file(file.path) as handle:
                schemas.append((file.path, pq.read_schema(handle)))
        path, schema = schemas[0]
        self.names = schema.names
        for other_path, other in schemas[1:]:
            if other.names != schema.names:
                raise GenrecError(f"{other_path}: columns {other.names} differ from {path}'s {schema.names}")
        if "user_id" not in schema.names:
            raise GenrecError(f"{path}: column 'user_id' is missing (have {schema.names})")
        kind = schema.field("user_id").type
        for other_path, other in schemas[1:]:  # one type: 42 and "42" are different users, and one output column
            if other.field("user_id").type != kind:
                raise GenrecError(f"{other_path}: column 'user_id' is {other.field('user_id').type}, {path}'s {kind}")
        if not (pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise GenrecError(f"{path}: column 'user_id' must hold integers or strings, not {kind}")
        missing = self.layout.missing(schema.names)
        if missing:
            needed = " or ".join(repr(c) for c in missing)
            raise GenrecError(f"{path}: needs a column {needed} (have {schema.names})")
        return self.layout.columns(schema.names)

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    @property
    def unread(self) -> list[str]:
        """The input's columns the job does not read (the driver warns of them)."""
        return [name for name in self.names if name not in self.columns]

    def fingerprint(self) -> str:
        text = json.dumps([(f.path.rsplit("/", 1)[-1], f.footer) for f in self.files])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def shards(self, rows_per_shard: int) -> list[Shard]:
        """The input's shards, each with its repeats (reads the user_id column of every file)."""
        first = self.first_rows()
        offsets = np.cumsum([0, *(f.rows for f in self.files)])
        repeated = np.flatnonzero((first >= 0) & (first != np.arange(len(first))))  # input rows, in order
        out = []
        for k, file in enumerate(self.files):
            for start in range(0, file.rows, rows_per_shard):
                stop = min(start + rows_per_shard, file.rows)
                lo, hi = np.searchsorted(repeated, [offsets[k] + start, offsets[k] + stop])
                repeats = tuple(
                    Repeat(int(row - offsets[k] - start), self._reason(int(first[row]), k, offsets))
                    for row in repeated[lo:hi]
                )
                out.append(Shard(len(out), file.path, start, stop, repeats))
        return out

    def first_rows(self) -> np.ndarray:
        """For every input row (files concatenated): the first input row with its user_id; -1 for a null one."""
        chunks = []
        for file in self.files:
            with self.fs.open_input_file(file.path) as handle:
                chunks += pq.ParquetFile(handle).read(columns=["user_id"]).column(0).chunks
        user_ids = pa.chunked_array(chunks, type=chunks[0].type if chunks else pa.int64())
        groups = pc.index_in(user_ids, value_set=pc.unique(user_ids)).to_numpy()  # one number per distinct id
        values, first_of_group = np.unique(groups, return_index=True)
        first = first_of_group[np.searchsorted(values, groups)].astype(np.int64)
        first[user_ids.is_null().to_numpy(zero_copy_only=False)] = -1
        return first

    def _reason(self, first: int, file_index: int, offsets: np.ndarray) -> str:
        """The refusal of a repeat of input row `first` found in file `file_index`."""
        k = int(np.searchsorted(offsets, first, side="right")) - 1
        where = "" if k == file_index else f" of {self.files[k].path.removeprefix(self.root).lstrip('/')}"
        return f"repeats row {first - offsets[k]}{where}"

    def read(self, shard: Shard) -> pa.Table:
        """A shard's rows: the row groups that cover it, kept while consecutive shards fall in them."""
        file = next(f for f in self.files if f.path == shard.path)
        starts, ends = file.row_group_starts, (*file.row_group_starts[1:], file.rows)
        groups = [i for i, (s, e) in enumerate(zip(starts, ends, strict=True)) if s < shard.stop and e > shard.start]
        if self._read is None or self._read[0] != (shard.path, groups):
            with self.fs.open_input_file(shard.path) as handle:
                table = pq.ParquetFile(handle).read_row_groups(groups, columns=self.columns)
            self._read = ((shard.path, groups), table)
        return self._read[1].slice(shard.start - starts[groups[0]], shard.rows)


def _parquet_files(fs: pafs.FileSystem, root: str) -> list[str]:
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    visible = [i for i in infos if i.type == pafs.FileType.File and not i.base_name.startswith((".", "_"))]
    return sorted(i.path for i in visible if i.path.endswith(".parquet"))
