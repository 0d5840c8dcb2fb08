"""Semantic IDs from item embeddings: residual k-means per level, plus a last level that makes codes unique.

Assignment is capacity-bounded: an item goes to its nearest center unless the code prefix that makes is full (holds
as many items as the levels below have codes), then to the nearest with room. So a skewed catalog never overflows
the last level, and any catalog that fits the code space gets codes.
"""

from __future__ import annotations

from math import prod
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from genrec.catalog.catalog import Catalog, bytes_version, parquet_bytes
from genrec.catalog_tools.codebooks import BUILT_WITH_KEY, Codebooks
from genrec.catalog_tools.lock import catalog_lock
from genrec.errors import GenrecError
from genrec.files import write_atomically


def kmeans(x: torch.Tensor, k: int, iters: int, generator: torch.Generator) -> torch.Tensor:
    """Plain Lloyd's k-means: centers [min(k, n), dim]. Empty clusters keep their center."""
    k = min(k, len(x))
    centers = x[torch.randperm(len(x), generator=generator)[:k]].clone()
    for _ in range(iters):
        assign = torch.cdist(x, centers).argmin(dim=1)
        sums = torch.zeros_like(centers).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=k)
        filled = counts > 0
        centers[filled] = sums[filled] / counts[filled, None]
    return centers


def balanced_assign(dist: torch.Tensor, group: np.ndarray, room: int) -> np.ndarray:
    """Nearest center per row, with at most `room` rows of one group on one center (a group of at most k * room
    rows always fits)."""
    none = np.zeros(0, dtype=np.int64)
    return assign_with_room(dist, group * dist.shape[1], room, none, none)


def assign_with_room(dist: torch.Tensor, base: np.ndarray, capacity: int, keys, counts) -> np.ndarray:
    """Rows' centers: the nearest whose child prefix (base + center) holds fewer than `capacity` items (the held
    ones, `keys`/`counts` sorted by key, and the rows nearer to it); -1 where none has room. An overflowing prefix's
    farthest rows move to their next nearest center, until none overflows; a full center stays full (it only trades
    rows for nearer ones), so rows that fit all find a place, in at most k rounds."""
    n = len(dist)
    dist, rows = dist.clone(), np.arange(n)
    assign = dist.argmin(dim=1).numpy()
    while True:
        key = base + assign
        held = _count_of(key, keys, counts)
        chosen = dist[rows, assign].numpy()
        rank = _rank_within(key, np.lexsort((rows, chosen, key)))  # nearest first, then by row
        pending = np.flatnonzero((rank >= capacity - held) & np.isfinite(chosen))
        if not len(pending):
            return np.where(np.isfinite(chosen), assign, -1)
        taken = torch.from_numpy(pending)
        dist[taken, torch.from_numpy(assign[pending])] = torch.inf
        assign[pending] = dist[taken].argmin(dim=1).numpy()


def _count_of(key: np.ndarray, keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """counts[keys == key] for each key (0 for a key not in the sorted `keys`)."""
    if not len(keys):
        return np.zeros(len(key), dtype=np.int64)
    at = np.searchsorted(keys, key).clip(max=len(keys) - 1)
    return np.where(keys[at] == key, counts[at], 0)


def codes_and_codebooks(
    embeddings: np.ndarray, codebooks: list[int], last_size: int, iters=20, seed=0, item_ids=None, source="embeddings"
) -> tuple[np.ndarray, Codebooks]:
    """Codes [n, len(codebooks)+1] (residual k-means levels, then a rank among items with the same prefix), and the
    codebooks that code a new item the same way (`genrec catalog add`)."""
    x = _checked_matrix(embeddings, item_ids, source)
    sizes = [*codebooks, last_size]
    if len(x) > prod(sizes):
        raise GenrecError(
            f"{source}: {len(x)} items do not fit in {len(sizes)} levels of {sizes} tokens ({prod(sizes)} codes): "
            "use a model with more levels or a larger codebook"
        )
    scale = x.abs().max().clamp_min(torch.finfo(x.dtype).tiny)
    x = x / scale  # k-means is scale-free; this keeps cdist finite
    generator = torch.Generator().manual_seed(seed)
    residual, prefix, columns, kept = x.clone(), np.zeros(len(x), dtype=np.int64), [], []
    for level, k in enumerate(codebooks):
        centers = kmeans(residual, k, iters, generator)
        kept.append(centers)
        assign = balanced_assign(torch.cdist(residual, centers), prefix, room=prod(sizes[level + 1 :]))
        residual = residual - centers[assign]
        prefix = np.unique(prefix * len(centers) + assign, return_inverse=True)[1].reshape(-1)
        columns.append(assign)
    rank = _rank_within(prefix, np.argsort(prefix, kind="stable"))
    return np.stack([*columns, rank], axis=1), Codebooks(float(scale), tuple(kept), last_size)


def _rank_within(key: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Each row's rank among the rows with its key, in `order` (a permutation that sorts by key)."""
    sorted_key = key[order]
    rank = np.empty(len(key), dtype=np.int64)
    rank[order] = np.arange(len(key)) - np.searchsorted(sorted_key, sorted_key, side="left")
    return rank


def _checked_matrix(embeddings, item_ids, source: str) -> torch.Tensor:
    x = torch.as_tensor(np.asarray(embeddings, dtype=np.float32))
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise GenrecError(f"{source}: expected a non-empty [items, dim] matrix of embeddings, got {tuple(x.shape)}")
    bad = torch.nonzero(~torch.isfinite(x).all(dim=1)).flatten().tolist()
    if bad:
        row = bad[0]
        name = f"item {item_ids[row]!r} (row {row})" if item_ids is not None else f"row {row}"
        raise GenrecError(
            f"{source}: {name} has a non-finite embedding value (NaN, infinity, or beyond float32); "
            f"{len(bad)} rows affected"
        )
    return x


def catalog_and_codebooks(
    item_ids, embeddings, layout, iters=20, seed=0, source="embeddings"
) -> tuple[Catalog, Codebooks]:
    """Item IDs + embeddings [n, dim] -> a validated catalog of the model's SID layout (level l's codebook is that
    level's tokens, in code-index order) and the codebooks to save beside it (`Codebooks.path_beside`)."""
    sizes = layout.level_sizes
    codes, codebooks = codes_and_codebooks(embeddings, sizes[:-1], sizes[-1], iters, seed, item_ids, source)
    token_ids = np.stack([layout.level_ids[level][codes[:, level]] for level in range(len(sizes))], axis=1)
    return Catalog.validated(np.asarray(item_ids, dtype=object), token_ids, layout, source), codebooks


def build_target(out: str | Path | None, model_catalog: Path) -> Path:
    """Where build-ids writes: the model's catalog (rebuilt), or a new file `out` whose folder holds no other
    catalog's codebooks (they are written beside it); checked before anything is built."""
    if out is None or Path(out).resolve() == model_catalog.resolve():
        return model_catalog
    out, beside = Path(out), Codebooks.path_beside(Path(out))
    if out.is_dir():
        raise GenrecError(f"--out {out}: is a directory; name the catalog file to write")
    if out.exists():
        raise GenrecError(f"--out {out}: exists; build-ids writes a new catalog file (remove it, or name another)")
    if beside.resolve() == Codebooks.path_beside(model_catalog).resolve():
        raise GenrecError(
            f"--out {out}: its codebooks would replace those of the model's catalog ({beside}); write it in a folder "
            "of its own"
        )
    if beside.exists():
        raise GenrecError(f"--out {out}: {beside} is beside it, another catalog's codebooks; write it elsewhere")
    return out


def write_built(target: Path, table: pa.Table, codebooks: Codebooks) -> None:
    """A built catalog (`table`) and its codebooks, under the catalog's lock (two builds at once land one after the
    other): the codebooks first, then the catalog recording their hash, so a run cut between the two leaves a
    catalog naming codebooks other than those beside it, which `catalog add` refuses instead of coding with them."""
    data = codebooks.to_bytes()
    with catalog_lock(target):
        write_atomically(Codebooks.path_beside(target), data)
        metadata = (table.schema.metadata or {}) | {BUILT_WITH_KEY: bytes_version(data).encode()}
        write_atomically(target, parquet_bytes(table.replace_schema_metadata(metadata)))


def build_catalog_and_codebooks(embeddings_path: Path, layout, iters=20, seed=0) -> tuple[Catalog, Codebooks]:
    item_ids, vectors = read_item_embeddings(embeddings_path)
    return catalog_and_codebooks(item_ids, vectors, layout, iters, seed, str(embeddings_path))


def read_item_embeddings(embeddings_path: Path) -> tuple[np.ndarray, list]:
    """(item IDs [n] object, embeddings as n lists of one length) from Parquet with columns item_id, embedding."""
    if not Path(embeddings_path).is_file():
        raise GenrecError(f"{embeddings_path}: no such file (expected Parquet with item_id, embedding)")
    table = pq.read_table(embeddings_path)
    for column in ("item_id", "embedding"):
        if column not in table.column_names:
            raise GenrecError(f"{embeddings_path}: column {column!r} is missing (have {table.column_names})")
    kind = table.schema.field("embedding").type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)) or not (
        pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type)
    ):
        raise GenrecError(f"{embeddings_path}: column 'embedding' must be a list of numbers per item, not {kind}")
    try:
        item_ids = np.array(table.column("item_id").to_pylist(), dtype=object)
    except UnicodeDecodeError as err:
        raise GenrecError(f"{embeddings_path}: column 'item_id' holds text that is not UTF-8 ({err})") from None
    vectors = table.column("embedding").to_pylist()
    lengths = [len(v) if v is not None else 0 for v in vectors]
    if len(set(lengths)) > 1 or 0 in lengths:
        row = next(i for i, n in enumerate(lengths) if n != max(lengths) or n == 0)
        raise GenrecError(
            f"{embeddings_path}: column 'embedding' is null, empty or of another length on row {row} "
            f"(item {item_ids[row]!r}: {lengths[row]} values; lengths seen: {sorted(set(lengths))})"
        )
    return item_ids, vectors
