"""`genrec catalog import`: other projects' item maps (`FORMATS`) read into genrec's catalog, every code checked
against the model's tokenizer and SID layout (docs/open-checkpoints.md, '`genrec catalog import`').

Written atomically as a new version (`changes.write_version`) beside the model's catalog or at `out` (the model's
own when it has none); replacing a file needs `in_place`, and a trained catalog `force` too, which deletes build-ids'
codebooks: they describe the catalog build-ids wrote, not an imported one. `out`'s file, else the model's catalog
(whether it exists decides where a new catalog goes), is locked while the run writes (`catalog_lock`). An imported
catalog is marked so in its Parquet metadata, and `genrec catalog add` refuses it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from genrec.catalog.catalog import CATALOG_COLUMNS, PAD, Catalog, padded_rows
from genrec.catalog_tools.changes import IMPORTED_KEY, write_version
from genrec.catalog_tools.codebooks import Codebooks
from genrec.catalog_tools.lock import catalog_lock
from genrec.errors import CatalogError, GenrecError, ModelDirectoryError
from genrec.files import write_atomically
from genrec.model.directory import ModelDir
from genrec.model.sid_layout import LAYOUT_FILE, PRESETS, SidLayout
from genrec.model.tokenizer import load_tokenizer

FORMATS = ("pid2sid", "index-json", "jsonl", "genrec")


@dataclass
class ImportedCatalog:
    """Rows read from a source file: item IDs, codes as token IDs ([N, longest] int64, PAD past each row's length;
    no wrappers), optional popularity and, from a genrec catalog, its attribute columns as they are."""

    item_ids: list[str]
    codes: np.ndarray
    lengths: np.ndarray
    popularity: list[float] | None = None
    attributes: pa.Table | None = None

    @classmethod
    def from_rows(cls, item_ids, rows: list[list[int]], layout, popularity=None) -> ImportedCatalog:
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        flat = np.fromiter((t for r in rows for t in r), dtype=np.int64, count=int(lengths.sum()))
        return cls(item_ids, *unwrapped(padded_rows(flat, lengths), lengths, layout), popularity)

    def check_loads(self, layout, source: Path) -> None:
        """What the engine's catalog loader checks, so the written catalog is known to load."""
        popularity = np.asarray(self.popularity, dtype=np.float64) if self.popularity is not None else None
        Catalog.validated(self.item_ids, (self.codes, self.lengths), layout, source, popularity)

    def table(self) -> pa.Table:
        offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int32)
        values = self.codes[np.arange(self.codes.shape[1])[None, :] < self.lengths[:, None]]
        columns = {
            "item_id": pa.array(self.item_ids, pa.string()),
            "semantic_id": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.int32())),
        }
        if self.popularity is not None:
            columns["popularity"] = pa.array(self.popularity, pa.float64())
        table = pa.table(columns)
        for name in self.attributes.column_names if self.attributes is not None else ():
            table = table.append_column(name, self.attributes.column(name))
        return table


@dataclass(frozen=True)
class ImportSummary:
    catalog: Path
    catalog_version: str
    format: str
    items: int
    codes: int  # distinct codes
    shared_codes: int  # codes that name more than one item
    code_lengths: dict[int, int]  # tokens per code -> items
    warning: str | None = None  # a catalog that loads but is likely not what the model was trained with

    def as_dict(self) -> dict:
        return {**self.__dict__, "catalog": str(self.catalog)}


def import_catalog(
    model_dir: str | Path,
    source: str | Path,
    fmt: str | None = None,
    out: str | Path | None = None,
    layout_preset: str | None = None,
    in_place: bool = False,
    force: bool = False,
) -> ImportSummary:
    """Read `source` (format `fmt`, or told from the file), check it and write it (the module doc: `out`, `in_place`,
    `force`). `layout_preset`: the layout to check against and, once the catalog is written, to record in
    `genrec/sid_layout.json` (`write_layout_preset`); a failed import changes neither file."""

    model_dir, source = Path(model_dir), Path(source)
    if not source.is_file():
        raise CatalogError(source, "no such file")
    tokenizer, layout = _model_tokens(model_dir, layout_preset)
    fmt = fmt or detect_format(source)
    if fmt not in FORMATS:
        raise CatalogError(source, f"unknown format {fmt!r}; choose one of {list(FORMATS)}")
    imported = READERS[fmt](source, tokenizer, layout)
    check_rows(imported, layout, source)
    imported.check_loads(layout, source)
    own = ModelDir.catalog_path_of(model_dir)
    with catalog_lock(Path(out) if out is not None else own):  # the module doc
        target, version = _write_imported(imported, fmt, own, out, in_place, force)
        if layout_preset is not None:
            write_layout_preset(model_dir, layout_preset)
    return summarize(imported, fmt, target, layout, version)


def _write_imported(imported: ImportedCatalog, fmt: str, own: Path, out, in_place: bool, force: bool):
    """The catalog written (the module doc: `out`, `in_place`, `force`), a trained one's codebooks deleted when it
    is replaced. Returns (path, catalog_version)."""
    rewrite = own if in_place or not own.exists() else None  # the model's first catalog is its own
    replaced = Path(out) if out is not None else rewrite
    trained = replaced is not None and replaced.is_file() and Codebooks.path_beside(replaced).is_file()
    if trained and not force:
        raise GenrecError(
            f"{replaced}: a trained catalog (build-ids' codebooks beside it, which `catalog add` needs); replacing it "
            "drops them: pass --force to replace it, or leave out --out / --in-place to write a new version beside it"
        )
    table = imported.table()
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), IMPORTED_KEY: fmt.encode()})
    target, version = write_version(table, own.parent, out, rewrite)
    if trained:
        Codebooks.path_beside(target).unlink(missing_ok=True)  # they describe the catalog replaced
    return target, version


def detect_format(source: Path) -> str:
    """The format from the file's name, then its first bytes (Parquet's magic; JSON object per line or whole)."""
    if not source.is_file():
        raise CatalogError(source, "no such file")
    name = source.name.lower()
    if name.endswith(".index.json"):
        return "index-json"
    if name.endswith(".jsonl"):
        return "jsonl"
    with source.open("rb") as f:
        head = f.read(4096)
    if head.startswith(b"PAR1"):
        try:
            names = pq.read_schema(source).names
        except (pa.ArrowException, OSError) as err:
            raise CatalogError(source, f"not a readable Parquet file ({err})") from None
        if {"pid", "sid"} <= set(names):
            return "pid2sid"
        if {"item_id", "semantic_id"} <= set(names):
            return "genrec"
        raise CatalogError(source, f"a Parquet file with columns {names}: neither pid/sid nor item_id/semantic_id")
    text = head.lstrip().decode("utf-8", errors="replace")
    first_line = text.split("\n", 1)[0]
    if first_line.startswith("{") and '"token_ids"' in first_line:
        return "jsonl"
    if text.startswith("{"):
        return "index-json"
    raise CatalogError(source, f"cannot tell the format from the file; pass --format ({', '.join(FORMATS)})")


def read_pid2sid(source: Path, tokenizer, layout) -> ImportedCatalog:
    """OpenOneRec's pid2sid.parquet: per-level code indexes, mapped to the layout's token IDs level by level."""
    table = _read_parquet(source, ("pid", "sid"))
    pids = table.column("pid")
    if pa.types.is_integer(pids.type) and not pids.null_count:  # OpenOneRec's: integers, as strings at once
        item_ids = pids.cast(pa.string()).to_pylist()
    else:
        item_ids = _string_ids(pids.to_pylist(), source, "pid")
    indexes, lengths = _list_column(table, "sid", source, item_ids)
    wrong_length = np.flatnonzero(lengths != layout.levels)  # OpenOneRec's codes are all of the layout's length
    if len(wrong_length):
        row = int(wrong_length[0])
        raise _row_error(source, row, item_ids[row], f"sid has {lengths[row]} levels; the layout has {layout.levels}")
    codes = np.full(indexes.shape, PAD, dtype=np.int64)
    for level in range(indexes.shape[1]):
        present = lengths > level
        codes[present, level] = layout.token_ids(level, indexes[present, level])
    unknown = (codes == PAD) & (np.arange(codes.shape[1])[None, :] < lengths[:, None])
    if unknown.any():
        row = int(np.flatnonzero(unknown.any(axis=1))[0])
        level = int(np.argmax(unknown[row]))
        problem = f"sid[{level}] = {indexes[row, level]} is not a code of level {level}"
        raise _row_error(source, row, item_ids[row], f"{problem} (it has {layout.level_sizes[level]} codes)")
    return ImportedCatalog(item_ids, codes, lengths, _popularity_column(table, source))


def read_index_json(source: Path, tokenizer, layout) -> ImportedCatalog:
    """`{"item": ["<a_60>", "<b_159>", ...]}`: token names, looked up in the vocabulary. An item key given twice is
    named (a JSON object would silently keep its last code)."""
    body = _read_json(source, object_pairs_hook=lambda pairs: _unique_keys(pairs, source))
    if not isinstance(body, dict) or not body:
        raise CatalogError(source, "must be a non-empty JSON object {item_id: [token names]}")
    vocab = tokenizer.get_vocab()
    item_ids, codes = [], []
    for row, (item, names) in enumerate(body.items()):
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise _row_error(source, row, item, f"the code must be a non-empty list of token names, not {names!r}")
        unknown = [n for n in names if n not in vocab]
        if unknown:
            raise _row_error(source, row, item, f"token {unknown[0]!r} is not in the model's vocabulary")
        item_ids.append(item)
        codes.append([vocab[n] for n in names])
    return ImportedCatalog.from_rows(item_ids, codes, layout)


def read_jsonl(source: Path, tokenizer, layout) -> ImportedCatalog:
    """One JSON object per line: `item_id`, `token_ids` (raw token IDs), optional `metadata` / `popularity`."""
    item_ids, codes, popularity = [], [], []
    vocab_size = len(tokenizer)
    with source.open(encoding="utf-8") as lines:
        for row, line in enumerate(_nonblank(lines, source)):
            record = _json_line(line, source, row)
            item = record.get("item_id")
            if isinstance(item, bool) or not isinstance(item, str | int) or item == "":
                raise _row_error(source, row, item, "item_id must be a non-empty string or an integer")
            ids = record.get("token_ids")
            if not isinstance(ids, list) or not ids or not all(_is_int(t) for t in ids):
                raise _row_error(source, row, item, f"token_ids must be a non-empty list of integers, not {ids!r}")
            outside = [t for t in ids if not 0 <= t < vocab_size]
            if outside:
                raise _row_error(
                    source, row, item, f"token ID {outside[0]} is outside the vocabulary [0, {vocab_size})"
                )
            item_ids.append(str(item))
            codes.append(ids)
            popularity.append(_record_popularity(record, source, row, item))
    if not item_ids:
        raise CatalogError(source, "has no rows")
    given = [p is not None for p in popularity]
    if any(given) and not all(given):
        row = given.index(False)
        raise _row_error(source, row, item_ids[row], "popularity is given on some rows; give it on every row or none")
    return ImportedCatalog.from_rows(item_ids, codes, layout, popularity if all(given) else None)


def read_genrec(source: Path, tokenizer, layout) -> ImportedCatalog:
    table = _read_parquet(source, ("item_id", "semantic_id"))
    kind = table.schema.field("item_id").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise CatalogError(source, f"column 'item_id' must hold strings, not {kind}")
    item_ids = table.column("item_id").to_pylist()
    codes, lengths = unwrapped(*_list_column(table, "semantic_id", source, item_ids), layout)
    attributes = table.drop_columns([c for c in CATALOG_COLUMNS if c in table.column_names])
    return ImportedCatalog(item_ids, codes, lengths, _popularity_column(table, source), attributes)


READERS = {"pid2sid": read_pid2sid, "index-json": read_index_json, "jsonl": read_jsonl, "genrec": read_genrec}


def check_rows(imported: ImportedCatalog, layout, source: Path) -> None:
    """Item IDs non-empty and unique; every code 1..levels tokens, token p of level p; errors name the row and item."""
    ids = imported.item_ids
    empty = next((row for row, item in enumerate(ids) if not isinstance(item, str) or not item), None)
    if empty is not None:
        raise _row_error(source, empty, ids[empty], "the item ID must be a non-empty string")
    if len(set(ids)) != len(ids):
        first_row: dict[str, int] = {}
        for row, item in enumerate(ids):
            if item in first_row:
                raise _row_error(source, row, item, f"duplicate item ID (first on row {first_row[item] + 1})")
            first_row[item] = row
    codes, lengths = imported.codes, imported.lengths
    too_long = np.flatnonzero(lengths > layout.levels)
    if len(too_long):
        row = int(too_long[0])
        raise _row_error(source, row, ids[row], f"the code has {lengths[row]} tokens; the layout has {layout.levels}")
    empty_codes = np.flatnonzero(lengths < 1)
    if len(empty_codes):
        row = int(empty_codes[0])
        raise _row_error(source, row, ids[row], "the code is empty (only wrapper tokens)")
    position = np.arange(codes.shape[1])[None, :]
    levels = layout.level_of(codes)
    wrong = (position < lengths[:, None]) & (levels != position)
    if wrong.any():
        row = int(np.flatnonzero(wrong.any(axis=1))[0])
        pos = int(np.argmax(wrong[row]))
        found = "is not a semantic-ID token" if levels[row, pos] < 0 else f"is a level-{int(levels[row, pos])} token"
        raise _row_error(source, row, ids[row], f"token {codes[row, pos]} at position {pos} {found}, not level {pos}")


def summarize(imported: ImportedCatalog, fmt: str, target: Path, layout, version: str) -> ImportSummary:
    rows = np.ascontiguousarray(imported.codes)  # one opaque value per row: np.unique without axis=0 (faster)
    _, counts = np.unique(rows.view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1]))), return_counts=True)
    sizes, items = np.unique(imported.lengths, return_counts=True)
    warning = None
    if len(sizes) > 1 and not layout.has_ending:
        warning = (
            f"codes of {sizes.tolist()} tokens and a layout without an ending ({layout.source}): a shorter code "
            "scores without the stop the model learned after it (MiniOneRec: --layout minionerec)"
        )
    return ImportSummary(
        target,
        version,
        fmt,
        len(imported.lengths),
        len(counts),
        int((counts > 1).sum()),
        dict(zip(sizes.tolist(), items.tolist(), strict=True)),
        warning,
    )


def write_layout_preset(model_dir: str | Path, preset: str) -> Path:
    """`genrec/sid_layout.json` naming a preset, for a layout the token names do not tell (MiniOneRec's `<a_N>` read
    as genrec's, which has no ending). One already there is kept if it names the same preset, else refused."""
    path = _preset_file(Path(model_dir), preset)
    if not path.exists():
        write_atomically(path, (json.dumps(_preset_body(preset)) + "\n").encode())
    return path


def _preset_body(preset: str) -> dict:
    return {"version": 1, "preset": preset}


def _preset_file(model_dir: Path, preset: str) -> Path:
    if preset not in PRESETS:
        raise ModelDirectoryError(model_dir, f"layout preset {preset!r} is not one of {sorted(PRESETS)}")
    path = model_dir / "genrec" / LAYOUT_FILE
    if path.exists() and _read_json(path) != _preset_body(preset):
        raise ModelDirectoryError(path, f"already says something else than preset {preset!r}: edit or remove it")
    return path


def _model_tokens(model_dir: Path, preset: str | None = None):
    """The model's tokenizer and SID layout, or `preset`'s (a ranker's directory has no codes to import)."""
    if not model_dir.is_dir():
        raise ModelDirectoryError(model_dir, "model directory does not exist")
    try:
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    if model_type == "genrec_hstu":
        raise ModelDirectoryError(model_dir, "an HSTU ranker's catalog maps items to embedding rows, not codes")
    tokenizer = load_tokenizer(model_dir)
    if preset is None:
        return tokenizer, SidLayout.for_model(model_dir, tokenizer)
    where = _preset_file(model_dir, preset)
    return tokenizer, SidLayout.from_spec(_preset_body(preset), tokenizer, where)


def unwrapped(codes: np.ndarray, lengths: np.ndarray, layout) -> tuple[np.ndarray, np.ndarray]:
    """The codes without the layout's begin token in front or its ending after, where the source wrote them."""
    codes, lengths = codes.copy(), lengths.copy()
    if layout.begin is not None and codes.shape[1]:
        begun = codes[:, 0] == layout.begin
        codes[begun, :-1] = codes[begun, 1:]
        codes[begun, -1] = PAD
        lengths[begun] -= 1
    ending = np.asarray(layout.ending, dtype=np.int64)
    if len(ending) and codes.shape[1]:
        tail = lengths[:, None] - len(ending) + np.arange(len(ending))[None, :]
        has = lengths > len(ending)
        tokens = np.take_along_axis(codes, tail.clip(0, codes.shape[1] - 1), axis=1)
        ended = has & (tokens == ending[None, :]).all(axis=1)
        rows = np.flatnonzero(ended)
        codes[rows[:, None], tail[rows]] = PAD
        lengths[ended] -= len(ending)
    return codes[:, : max(int(lengths.max(initial=0)), 1)], lengths  # no column of PAD only


def _list_column(table: pa.Table, name: str, source: Path, item_ids) -> tuple[np.ndarray, np.ndarray]:
    """A column of integer lists as ([N, longest] int64 PAD-filled, lengths); nulls and empty lists named by row."""
    kind = table.schema.field(name).type
    is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    if not is_list or not pa.types.is_integer(kind.value_type):
        raise CatalogError(source, f"column {name!r} must hold lists of integers, not {kind}")
    column = table.column(name).combine_chunks()
    lengths = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    empty = np.flatnonzero(lengths == 0)
    if len(empty):
        row = int(empty[0])
        raise _row_error(source, row, item_ids[row], f"{name} is null or empty")
    values = pc.list_flatten(column)
    if values.null_count:
        row = int(np.flatnonzero(pc.list_value_length(column).to_numpy() != _non_null_lengths(column))[0])
        raise _row_error(source, row, item_ids[row], f"{name} holds a null")
    try:
        flat = values.cast(pa.int64()).to_numpy()
    except pa.ArrowInvalid as err:
        raise CatalogError(source, f"column {name!r} holds an integer outside int64 ({err})") from None
    return padded_rows(flat, lengths), lengths


def _non_null_lengths(column) -> np.ndarray:
    return np.array([sum(v is not None for v in row) for row in column.to_pylist()], dtype=np.int64)


def _read_parquet(source: Path, required: tuple[str, ...]) -> pa.Table:
    try:
        table = pq.read_table(source)
    except (pa.ArrowException, OSError) as err:
        raise CatalogError(source, f"not a readable Parquet file ({err})") from None
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise CatalogError(source, f"column {missing[0]!r} is missing (have {table.column_names})")
    if not len(table):
        raise CatalogError(source, "has no rows")
    return table


def _read_json(source: Path, **options):
    try:
        return json.loads(source.read_text(encoding="utf-8"), **options)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CatalogError(source, f"not readable as JSON ({err})") from None
    except RecursionError:
        raise CatalogError(source, "not readable as JSON: nested too deeply") from None


def _unique_keys(pairs: list, source: Path) -> dict:
    first_row: dict[str, int] = {}
    for row, (key, _) in enumerate(pairs):
        if key in first_row:
            raise _row_error(source, row, key, f"duplicate item ID (first on row {first_row[key] + 1})")
        first_row[key] = row
    return dict(pairs)


def _nonblank(lines, source: Path):
    try:
        yield from (line for line in lines if line.strip())
    except UnicodeDecodeError as err:
        raise CatalogError(source, f"not UTF-8 text ({err})") from None


def _json_line(line: str, source: Path, row: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise CatalogError(source, f"row {row + 1}: not a JSON object ({err})") from None
    except RecursionError:
        raise CatalogError(source, f"row {row + 1}: not a JSON object: nested too deeply") from None
    if not isinstance(record, dict):
        raise CatalogError(source, f"row {row + 1}: not a JSON object")
    return record


def _record_popularity(record: dict, source: Path, row: int, item) -> float | None:
    metadata = record.get("metadata")
    value = record.get("popularity", metadata.get("popularity") if isinstance(metadata, dict) else None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value):
        raise _row_error(source, row, item, f"popularity must be a finite number, not {value!r}")
    return float(value)


def _popularity_column(table: pa.Table, source: Path) -> list[float] | None:
    if "popularity" not in table.column_names:
        return None
    column = table.column("popularity")
    if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        raise CatalogError(source, f"column 'popularity' must be numeric, not {column.type}")
    values = column.cast(pa.float64()).to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(~np.isfinite(values))
    if len(bad):
        raise CatalogError(source, f"row {bad[0] + 1}: popularity must be a finite number ({len(bad)} rows affected)")
    return values.tolist()


def _string_ids(values: list, source: Path, column: str) -> list[str]:
    out = []
    for row, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
            raise CatalogError(
                source, f"row {row + 1}: {column} must be a non-empty string or an integer, not {value!r}"
            )
        out.append(str(value))
    return out


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _row_error(source: Path, row: int, item, problem: str) -> CatalogError:
    return CatalogError(source, f"row {row + 1} (item {item!r}): {problem}")
