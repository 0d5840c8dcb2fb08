"""`genrec catalog add` / `retire`: new items coded from their embeddings with build-ids' codebooks, items removed;
every change (an import's too, `write_version`) a new catalog version (docs/engine.md, 'New items without
retraining: `genrec catalog add` / `retire`'). An existing file is rewritten only when asked (`in_place`; replicas
serving it load the new content within seconds, serving/declared_catalog.py); the run holds `catalog_lock` on the
file it replaces from before it reads the catalog until it has written it, so of two runs at once the second reads
what the first wrote.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from genrec.catalog.catalog import Catalog, _codes, bytes_version, named_hash, parquet_bytes, versioned_name
from genrec.catalog_tools.build_ids import _checked_matrix, _rank_within, assign_with_room, read_item_embeddings
from genrec.catalog_tools.codebooks import Codebooks
from genrec.catalog_tools.lock import catalog_lock
from genrec.errors import CatalogError, GenrecError
from genrec.files import write_atomically
from genrec.model.directory import ModelDir


@dataclass(frozen=True)
class CatalogChange:
    added: int
    retired: int
    items: int  # in the new catalog
    catalog: Path
    catalog_version: str

    def as_dict(self) -> dict:
        return {**self.__dict__, "catalog": str(self.catalog)}


def add_items(
    model_dir: str | Path,
    items_path: str | Path,
    out: str | Path | None = None,
    base: str | Path | None = None,
    in_place: bool = False,
) -> CatalogChange:
    """Code `items_path`'s items (Parquet: item_id, embedding) and write the catalog `base` (default the model's) with
    them appended (`write_version`). A catalog imported from another project is refused (its codes are not theirs)."""
    with _opened(model_dir, base, out, in_place) as (directory, layout, catalog, base):
        beside = Codebooks.path_beside(directory.catalog_path)
        codebooks, version = Codebooks.load(beside)
        codebooks.check_layout(layout, beside)
        table = pq.read_table(base)
        if IMPORTED_KEY in (table.schema.metadata or {}):
            raise CatalogError(base, f"was imported (`genrec catalog import`): {NO_CODEBOOKS_OF_IMPORT}")
        Codebooks.check_built_with(version, table.schema.metadata, base, beside)
        item_ids, vectors = read_item_embeddings(Path(items_path))
        _check_new_ids(item_ids, catalog, items_path)
        embeddings = _checked_embeddings(vectors, codebooks.dim, item_ids, items_path)
        codes = new_codes(catalog, layout, codebooks, embeddings, item_ids, items_path)
        new_rows = _rows_like(table, item_ids.tolist(), codes)
        table = pa.concat_tables([table, new_rows], promote_options="default")
        return _write(table, layout, directory.catalog_path.parent, out, base if in_place else None, len(codes), 0)


def retire_items(
    model_dir: str | Path,
    item_ids: list[str],
    out: str | Path | None = None,
    base: str | Path | None = None,
    in_place: bool = False,
    given: str = "--items",
) -> CatalogChange:
    """Remove `item_ids` from the catalog `base` (their codes become free) and write a new version (as add_items).
    `given`: where the IDs came from, as errors name it."""
    with _opened(model_dir, base, out, in_place) as (directory, layout, catalog, base):
        retired = list(dict.fromkeys(item_ids))
        unknown = [item for item in retired if catalog.index_of(item) is None]
        if unknown:
            raise GenrecError(f"{given}: item {unknown[0]!r} is not in the catalog ({len(unknown)} of {len(retired)})")
        if len(retired) == len(catalog):
            raise GenrecError(f"{given}: retiring all {len(catalog)} items would leave the catalog empty")
        keep = np.ones(len(catalog), dtype=bool)
        keep[[catalog.index_of(item) for item in retired]] = False
        table = pq.read_table(base).filter(pa.array(keep))
        return _write(table, layout, directory.catalog_path.parent, out, base if in_place else None, 0, len(retired))


IMPORTED_KEY = b"genrec.imported_from"  # Parquet metadata of an imported catalog (kept by add / retire)
NO_CODEBOOKS_OF_IMPORT = (
    "its codes were not made with the codebooks beside the model's catalog, so new items cannot be coded into it; "
    "build a catalog with `genrec build-ids` to add items"
)


def write_version(table: pa.Table, folder: Path, out: str | Path | None, rewrite: Path | None) -> tuple[Path, str]:
    """`table` written to `out`, else over `rewrite` (in place), else to folder/catalog-<hash12>.parquet; a file there
    is replaced only in place or when its name carries this content's hash. Returns (path, catalog_version)."""
    data = parquet_bytes(table)
    version = bytes_version(data)
    target = Path(out) if out is not None else rewrite or folder / versioned_name(version)
    named = named_hash(target)
    if target.is_dir():
        raise GenrecError(f"--out {target}: is a directory; name the catalog file to write (or leave --out out)")
    if named is not None and not version.startswith(named):
        raise GenrecError(
            f"{target}: its name carries the hash {named}, the new catalog's is {version[:12]}: a catalog version is "
            f"never rewritten (leave out --out / --in-place to write {versioned_name(version)})"
        )
    if target.exists() and rewrite is None and named is None:
        raise GenrecError(
            f"{target}: exists; a catalog is rewritten in place only with --in-place (replicas serving it load the new "
            "content): leave --out out to write a new version, catalog-<hash>.parquet"
        )
    if target.exists() and not reads_as_catalog(target):
        raise GenrecError(f"{target}: exists and is not a catalog (Parquet with item_id, semantic_id): never replaced")
    write_atomically(target, data)
    return target, version


def reads_as_catalog(path: Path) -> bool:
    """Whether `path` is Parquet with a catalog's columns (what --in-place may rewrite)."""
    try:
        names = pq.read_schema(path).names
    except (pa.ArrowException, OSError):
        return False
    return {"item_id", "semantic_id"} <= set(names)


def read_item_list(items: str | None, items_file: str | Path | None = None) -> list[str]:
    """The item IDs of `--items` (separated by commas) or of `--items-file` (Parquet with item_id, else one ID a
    line): exactly one of them."""
    if (items is None) == (items_file is None):
        raise GenrecError("give the items to retire as --items A,B,... or --items-file FILE (one of them)")
    if items is not None:
        ids, given = [part.strip() for part in items.split(",")], f"--items {items[:60]!r}"
    else:
        ids, given = _ids_in_file(Path(items_file)), f"--items-file {items_file}"
    ids = [item for item in ids if item]
    if not ids:
        raise GenrecError(f"{given}: names no item")
    return ids


def _ids_in_file(path: Path) -> list[str]:
    if not path.is_file():
        raise GenrecError(f"--items-file {path}: no such file")
    if path.suffix == ".parquet":
        try:
            table = pq.read_table(path, columns=["item_id"])
        except (pa.ArrowException, OSError, KeyError) as err:
            raise GenrecError(f"--items-file {path}: not Parquet with an item_id column ({err})") from None
        return [str(item) for item in table.column("item_id").to_pylist() if item is not None]
    try:
        return [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    except UnicodeDecodeError as err:
        raise GenrecError(f"--items-file {path}: not UTF-8 text, one item ID a line ({err})") from None


def new_codes(catalog: Catalog, layout, codebooks: Codebooks, embeddings, item_ids, source) -> np.ndarray:
    """[n, levels] token IDs for new items: `_nearest_with_room` above the last level, then the first free last-level
    index under each prefix (among the catalog's items and the new items before it), in row order."""
    levels = layout.levels
    if (catalog.lengths != levels).any():
        raise CatalogError(source, f"the catalog has codes shorter than {levels} tokens: not one build-ids wrote")
    held = np.stack([_index_of(layout.level_ids[level], catalog.codes[:, level]) for level in range(levels)], axis=1)
    indices = _nearest_with_room(codebooks, embeddings, held[:, :-1], item_ids, source)
    prefixes = np.stack([layout.level_ids[level][indices[:, level]] for level in range(levels - 1)], axis=1)
    last = _first_free_last(catalog.codes, prefixes, layout, item_ids, source)
    return np.concatenate([prefixes, layout.level_ids[levels - 1][last][:, None]], axis=1)


def _index_of(level_ids: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Each token's position among its level's token IDs."""
    position = np.full(int(level_ids.max()) + 1, -1, dtype=np.int64)
    position[level_ids] = np.arange(len(level_ids))
    return position[tokens]


def _nearest_with_room(codebooks: Codebooks, embeddings, held: np.ndarray, item_ids, source) -> np.ndarray:
    """[n, levels-1] center indices, level by level on the residual, by build-ids' balanced rule (`held`: the catalog's
    items' center indices), so a retired item added back lands where build-ids put it. A prefix with room holds room
    below it, so no level needs to go back."""
    sizes = [len(c) for c in codebooks.centers] + [codebooks.last_size]
    residual = torch.as_tensor(np.asarray(embeddings, dtype=np.float32)) / codebooks.scale
    new_prefix, held_prefix = np.zeros(len(residual), dtype=np.int64), np.zeros(len(held), dtype=np.int64)
    columns = []
    for level, centers in enumerate(codebooks.centers):
        k, capacity = len(centers), int(np.prod(sizes[level + 1 :]))
        held_prefix = held_prefix * k + held[:, level]
        keys, counts = np.unique(held_prefix, return_counts=True)
        assign = assign_with_room(torch.cdist(residual, centers), new_prefix * k, capacity, keys, counts)
        stuck = np.flatnonzero(assign < 0)
        if len(stuck):
            row = int(stuck[0])
            raise CatalogError(
                source,
                f"row {row + 1} (item {item_ids[row]!r}): every code under its level-{level} prefix is taken; retire "
                "items or rebuild with build-ids",
            )
        residual = residual - centers[assign]
        new_prefix = new_prefix * k + assign
        columns.append(assign)
    return np.stack(columns, axis=1)


def _first_free_last(codes: np.ndarray, prefixes: np.ndarray, layout, item_ids, source) -> np.ndarray:
    """Each new item's last-level code position: the lowest one no item under its prefix holds (a new item before
    it in the file included). One [new prefixes, last-level codes] table of what is taken, no loop."""
    last_ids = layout.level_ids[-1]
    position_of = np.full(int(last_ids.max()) + 1, -1, dtype=np.int64)
    position_of[last_ids] = np.arange(len(last_ids))
    wanted_prefixes, wanted = np.unique(prefixes, axis=0, return_inverse=True)
    wanted = wanted.reshape(-1)
    both = np.concatenate([wanted_prefixes, codes[:, :-1]])
    _, key = np.unique(both, axis=0, return_inverse=True)
    key = key.reshape(-1)
    group_of_key = np.full(int(key.max()) + 1, -1, dtype=np.int64)
    group_of_key[key[: len(wanted_prefixes)]] = np.arange(len(wanted_prefixes))
    held_group = group_of_key[key[len(wanted_prefixes) :]]  # -1: an existing item under no new item's prefix
    under = held_group >= 0
    taken = np.zeros((len(wanted_prefixes), len(last_ids)), dtype=bool)
    taken[held_group[under], position_of[codes[under, -1]]] = True
    free_group, free_position = np.nonzero(~taken)  # row-major: by group, then lowest position first
    free_count = np.bincount(free_group, minlength=len(wanted_prefixes))
    rank = _rank_within(wanted, np.argsort(wanted, kind="stable"))  # among the new items of its prefix, row order
    full = np.flatnonzero(rank >= free_count[wanted])
    if len(full):
        row = int(full[0])
        raise CatalogError(
            source,
            f"row {row + 1} (item {item_ids[row]!r}): its code prefix {prefixes[row].tolist()} already holds all "
            f"{len(last_ids)} codes of the last level; retire items under it or rebuild with build-ids",
        )
    first_free = np.concatenate([[0], np.cumsum(free_count)[:-1]])
    return free_position[first_free[wanted] + rank]


@contextmanager
def _opened(model_dir, base, out, in_place: bool):
    """The model directory, its SID layout, the catalog to change (`base`, default the model's) and its path, with
    the file the change replaces (`replaced_file`) locked from before the catalog is read until the block ends."""
    directory = ModelDir.open(model_dir, family="qwen3")
    layout = directory.load_sid_layout()
    base = Path(base) if base is not None else directory.catalog_path
    replaced = replaced_file(base, out, in_place)
    with catalog_lock(replaced) if replaced is not None else nullcontext():
        yield directory, layout, Catalog.load(base, layout), base


def replaced_file(base: Path, out, in_place: bool) -> Path | None:
    """The named file a change writes, `--out`'s or (in place) the catalog changed, which another run may be
    rewriting too; None for a new version named by its content hash: written beside the catalog it was made from,
    which stays as it was, so two runs at once lose nothing (each version holds its own run's change)."""
    if out is not None:
        return Path(out)
    return base if in_place else None


def _check_new_ids(item_ids: np.ndarray, catalog: Catalog, source) -> None:
    seen: dict[str, int] = {}
    for row, item in enumerate(item_ids.tolist()):
        if not isinstance(item, str) or not item:
            raise CatalogError(source, f"row {row + 1}: item_id must be a non-empty string, not {item!r}")
        if catalog.index_of(item) is not None:
            raise CatalogError(source, f"row {row + 1} (item {item!r}): already in the catalog")
        if item in seen:
            raise CatalogError(source, f"row {row + 1} (item {item!r}): duplicate item ID (first on row {seen[item]})")
        seen[item] = row + 1


def _checked_embeddings(vectors: list, dim: int, item_ids, source) -> np.ndarray:
    width = len(vectors[0]) if vectors else 0
    if vectors and width != dim:
        raise CatalogError(
            source,
            f"row 1 (item {item_ids[0]!r}): column 'embedding' has {width} values; the codebooks were built from {dim}",
        )
    return _checked_matrix(vectors, item_ids, str(source)).numpy()


def _rows_like(table: pa.Table, item_ids: list[str], codes: np.ndarray) -> pa.Table:
    """New catalog rows with the existing table's column types (popularity 0 when it has that column)."""
    columns = {
        "item_id": pa.array(item_ids, table.schema.field("item_id").type),
        "semantic_id": pa.array(codes.tolist(), table.schema.field("semantic_id").type),
    }
    if "popularity" in table.column_names:
        columns["popularity"] = pa.array(np.zeros(len(item_ids)), table.schema.field("popularity").type)
    return pa.table(columns)


def _write(table: pa.Table, layout, folder: Path, out, rewrite, added: int, retired: int) -> CatalogChange:
    item_ids = np.array(table.column("item_id").to_pylist(), dtype=object)
    where = Path(out) if out is not None else rewrite or folder
    Catalog.validated(item_ids, _codes(table, where), layout, where)  # the engine loader's checks, before writing
    target, version = write_version(table, folder, out, rewrite)
    return CatalogChange(added, retired, len(table), target, version)
