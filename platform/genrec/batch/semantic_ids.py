"""Semantic IDs for a large item catalog: Ray Data reads and checks the embeddings in parallel (files, a
directory, a URI), the driver gathers one float32 matrix and runs build-ids' algorithm on it."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from genrec.batch.connect import ensure_ray
from genrec.errors import GenrecError


def build_semantic_ids(embeddings: str, model: str, out: str | None = None, iters: int = 20, seed: int = 0) -> dict:
    from genrec.batch.spec import model_dir
    from genrec.catalog_tools.build_ids import build_target, catalog_and_codebooks, write_built

    directory = model_dir(model, "qwen3")  # a bad model directory fails before any reading
    layout = directory.load_sid_layout()
    target = build_target(out, directory.catalog_path)
    item_ids, matrix = read_embeddings(embeddings)
    catalog, codebooks = catalog_and_codebooks(item_ids, matrix, layout, iters=iters, seed=seed, source=embeddings)
    write_built(target, catalog.to_table(), codebooks)  # the codebooks beside it, for `genrec catalog add`
    return {"items": len(catalog), "levels": catalog.levels, "dim": matrix.shape[1], "catalog": str(target)}


def read_embeddings(uri: str) -> tuple[np.ndarray, np.ndarray]:
    """(item_ids [n] object, embeddings [n, dim] float32) from Parquet with columns item_id, embedding."""
    ray = ensure_ray()
    try:
        dataset = ray.data.read_parquet(uri)
        names = dataset.schema().names
    except (OSError, pa.ArrowException, FileNotFoundError) as err:
        raise GenrecError(f"{uri}: not readable as Parquet ({err})") from None
    for column in ("item_id", "embedding"):
        if column not in names:
            raise GenrecError(f"{uri}: column {column!r} is missing (have {names})")
    blocks = dataset.select_columns(["item_id", "embedding"]).map_batches(fixed_size_block, batch_format="pyarrow")
    blocks.context.execution_options.preserve_order = True  # k-means depends on row order: keep the files'
    tables = [t for t in ray.get(blocks.to_arrow_refs()) if t.num_rows]
    problems = [t.column("problem")[0].as_py() for t in tables if "problem" in t.column_names]
    if problems:
        raise GenrecError(f"{uri}: {problems[0]}")
    if not tables:
        raise GenrecError(f"{uri}: no items")
    dims = sorted({t.schema.field("embedding").type.list_size for t in tables})
    if len(dims) > 1:
        raise GenrecError(f"{uri}: embeddings have different lengths {dims}")
    table = pa.concat_tables(tables)
    values = table.column("embedding").combine_chunks().flatten().to_numpy(zero_copy_only=False, writable=True)
    matrix = values.reshape(len(table), dims[0])
    return table.column("item_id").to_numpy(zero_copy_only=False), matrix


def fixed_size_block(batch: pa.Table) -> pa.Table:
    """One block as item_id + fixed-size float32 vectors, or a one-row `problem` naming the first bad item
    (reported by the driver as one clear error, not a worker traceback)."""
    embedding = batch.column("embedding").combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(embedding), 0).to_numpy()
    if len(lengths) == 0:
        return pa.table({"item_id": pa.array([], pa.string()), "embedding": pa.array([], pa.list_(pa.float32(), 1))})
    bad = np.flatnonzero((lengths == 0) | (lengths != lengths.max()))
    if len(bad):
        row = int(bad[0])
        problem = (
            f"item {batch.column('item_id')[row].as_py()!r} has a null, empty or differently sized embedding "
            f"({int(lengths[row])} values; others have {int(lengths.max())})"
        )
        return pa.table({"problem": [problem]})
    values = pc.cast(embedding.flatten(), pa.float32())
    vectors = pa.FixedSizeListArray.from_arrays(values, int(lengths[0]))
    return pa.table({"item_id": batch.column("item_id"), "embedding": vectors})
