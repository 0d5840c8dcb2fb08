"""The demo's catalog: build-ids' codes of the SVD item factors, the codebooks that code a new item the same way
(`genrec catalog add`), and each movie's genres, release year and decade as item attributes (what filters read).

A model trained before the codebooks and attributes were written gets them added (`complete_catalog`): the codes
are deterministic in the data, the factors and the seed, so the same build gives them again; the catalog file is
rewritten only if its codes are the ones found.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from genrec.catalog import Catalog
from genrec.catalog_tools.build_ids import catalog_and_codebooks, write_built
from genrec.catalog_tools.codebooks import Codebooks
from genrec.errors import GenrecError
from genrec.model.directory import ModelDir
from genrec_demo.data import MovieLens
from genrec_demo.factors import Factors

ATTRIBUTES = ("genres", "year", "decade")


def build_catalog(data: MovieLens, factors: Factors, layout, seed: int) -> tuple[Catalog, Codebooks]:
    return catalog_and_codebooks(data.item_ids, factors.items, layout, seed=seed, source="SVD item factors")


def write_catalog(path: Path, catalog: Catalog, codebooks: Codebooks, data: MovieLens) -> None:
    """The catalog with the movies' attributes, atomically, and the codebooks beside it (as build-ids writes them)."""
    table = catalog.to_table()
    for name, column in item_attributes(data, catalog.item_ids.tolist()).items():
        table = table.append_column(name, column)
    write_built(path, table, codebooks)


def item_attributes(data: MovieLens, item_ids: list[str]) -> dict[str, pa.Array]:
    row = {item: k for k, item in enumerate(data.item_ids)}
    rows = [row[item] for item in item_ids]
    years = [data.years[k] for k in rows]
    return {
        "genres": pa.array([data.genres[k] for k in rows], pa.list_(pa.string())),
        "year": pa.array(years, pa.int32()),
        "decade": pa.array([None if y is None else y // 10 * 10 for y in years], pa.int32()),
    }


def complete_catalog(model_dir: Path, data: MovieLens, factors: Factors, seed: int) -> bool:
    """Add the codebooks and the attributes to a model's catalog that lacks them; True if it did."""
    directory = ModelDir.open(model_dir, family="qwen3")
    path = directory.catalog_path
    has = set(pq.read_schema(path).names)
    if Codebooks.path_beside(path).is_file() and has.issuperset(ATTRIBUTES):
        return False
    layout = directory.load_sid_layout()
    served = Catalog.load(path, layout)
    catalog, codebooks = build_catalog(data, factors, layout, seed)
    same = catalog.item_ids.tolist() == served.item_ids.tolist() and np.array_equal(catalog.codes, served.codes)
    if not same:
        raise GenrecError(f"{path}: its codes are not this recipe's build; train the model again (--retrain)")
    write_catalog(path, catalog, codebooks, data)
    return True
