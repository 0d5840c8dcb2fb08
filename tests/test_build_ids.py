"""build-ids on catalogs that stress it: skew, a full code space, bad embeddings."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from genrec.catalog import Catalog
from genrec.catalog_tools.build_ids import balanced_assign, build_catalog_and_codebooks, codes_and_codebooks
from genrec.cli import app
from genrec.errors import GenrecError
from genrec.model.sid_layout import SidLayout
from genrec.model.tokenizer import load_tokenizer


def ranges_layout(*ranges):
    """A SID layout of contiguous token-ID ranges [first, last] per level."""
    ids = tuple(np.arange(lo, hi + 1) for lo, hi in ranges)
    return SidLayout(level_ids=ids, level_indices=tuple(np.arange(len(i)) for i in ids))


def _write(path, vectors, ids=None):
    ids = ids if ids is not None else [f"x{i}" for i in range(len(vectors))]
    pq.write_table(pa.table({"item_id": ids, "embedding": [None if v is None else list(v) for v in vectors]}), path)
    return path


def test_200_random_items_fit_a_3x8_model(tiny_dir, tmp_path):
    """The conftest model has 3 levels of 8 tokens: 512 codes, room for 200 items."""
    emb = _write(tmp_path / "items.parquet", np.random.default_rng(0).normal(size=(200, 8)))
    out = tmp_path / "catalog.parquet"
    result = CliRunner().invoke(app, ["build-ids", str(emb), "--model", str(tiny_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    catalog = Catalog.load(out, SidLayout.infer(load_tokenizer(tiny_dir)))
    assert len(catalog) == 200 and len(np.unique(catalog.codes, axis=0)) == 200


def test_skewed_catalog_gets_unique_codes_and_keeps_its_clusters():
    """70% of the items on one tight blob would put far more than 16 items on one prefix without capacity."""
    rng = np.random.default_rng(1)
    blob = rng.normal(size=(700, 6)) * 0.01 + 5.0
    centers = rng.normal(size=(6, 6)) * 20
    small = np.repeat(np.arange(6), 50)
    spread = centers[small] + rng.normal(size=(300, 6)) * 0.1
    codes = codes_and_codebooks(np.concatenate([blob, spread]), codebooks=[16, 16], last_size=16, seed=0)[0]
    assert len(np.unique(codes, axis=0)) == 1000 and codes.max() < 16
    first = codes[700:, 0]
    for code in np.unique(first):  # moved blob items never mix two separated clusters on one first-level code
        assert len(np.unique(small[first == code])) == 1


@pytest.mark.parametrize("shape", [(512, 8), (64, 3)])
def test_a_full_code_space_and_identical_embeddings(shape):
    n, dim = shape
    codes = codes_and_codebooks(np.ones((n, dim)), codebooks=[8, 8], last_size=8)[0]
    assert len(np.unique(codes, axis=0)) == n
    codes = codes_and_codebooks(np.random.default_rng(2).normal(size=(n, dim)), codebooks=[8, 8], last_size=8)[0]
    assert len(np.unique(codes, axis=0)) == n


def test_more_items_than_codes_is_refused_up_front():
    with pytest.raises(GenrecError, match=r"513 items do not fit in 3 levels of \[8, 8, 8\] tokens \(512 codes\)"):
        codes_and_codebooks(np.random.default_rng(3).normal(size=(513, 4)), codebooks=[8, 8], last_size=8)[0]


def test_balanced_assign_moves_only_rows_whose_nearest_center_is_full_of_nearer_rows():
    rng = np.random.default_rng(4)
    dist = torch.tensor(rng.random((60, 5)), dtype=torch.float32)
    dist[:40, 0] -= 1.0  # most rows prefer center 0
    group = np.repeat([0, 1], 30)
    room = 7
    assign = balanced_assign(dist, group, room)
    counts = np.zeros((2, 5), dtype=int)
    np.add.at(counts, (group, assign), 1)
    assert counts.max() <= room
    d = dist.numpy()
    for row in range(60):
        mine = d[row, assign[row]]
        for center in np.flatnonzero(d[row] < mine):  # a nearer center must be full, of rows nearer to it
            holders = np.flatnonzero((group == group[row]) & (assign == center))
            assert len(holders) == room and (d[holders, center] <= d[row, center]).all()


def test_nan_embedding_names_the_item_and_row(tmp_path):
    vectors = np.random.default_rng(5).normal(size=(50, 4))
    vectors[17, 2] = np.nan
    path = _write(tmp_path / "nan.parquet", vectors)
    with pytest.raises(GenrecError, match=r"nan.parquet: item 'x17' \(row 17\) has a non-finite embedding"):
        build_catalog_and_codebooks(path, ranges_layout((10, 17), (18, 25), (26, 33)))


def test_null_or_ragged_embedding_names_the_row(tmp_path):
    vectors = [[0.0, 1.0]] * 5 + [None] + [[1.0, 0.0]] * 4
    path = _write(tmp_path / "null.parquet", vectors)
    with pytest.raises(GenrecError, match=r"null, empty or of another length on row 5 \(item 'x5'"):
        build_catalog_and_codebooks(path, ranges_layout((10, 17), (18, 25)))
    path = _write(tmp_path / "ragged.parquet", [[0.0, 1.0]] * 3 + [[1.0]])
    with pytest.raises(GenrecError, match=r"on row 3 \(item 'x3': 1 values"):
        build_catalog_and_codebooks(path, ranges_layout((10, 17), (18, 25)))
