"""The flat prefix trie and semantic-ID building."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from typer.testing import CliRunner

from genrec.catalog import Catalog, CodeTrie
from genrec.catalog.build_ids import residual_codes
from genrec.catalog.reference import allowed_tokens_fn
from genrec.cli import app
from genrec.model.tokenizer import load_tokenizer, semantic_token_ranges


def test_trie_children_equal_plain_prefix_sets():
    rng = np.random.default_rng(0)
    codes = np.unique(rng.integers(0, 6, size=(150, 3)), axis=0) + np.array([10, 20, 30])
    trie = CodeTrie.build(codes)
    allowed = allowed_tokens_fn(codes)
    # Walk every prefix with tensors, batched, and compare with the plain dictionary.
    frontier = torch.zeros(1, dtype=torch.int64)
    prefixes = [()]
    for level in range(3):
        token, child, valid = trie.children(level, frontier)
        next_frontier, next_prefixes = [], []
        for row, prefix in enumerate(prefixes):
            got = token[row][valid[row]].tolist()
            assert got == allowed(list(prefix))
            next_frontier += child[row][valid[row]].tolist()
            next_prefixes += [(*prefix, t) for t in got]
        frontier, prefixes = torch.tensor(next_frontier), next_prefixes
    # Leaves are item indices, in the order of their codes.
    assert [tuple(codes[i]) for i in frontier.tolist()] == prefixes
    assert sorted(frontier.tolist()) == list(range(len(codes)))


def test_leaf_counts_and_item_paths():
    codes = np.array([[0, 5], [0, 6], [1, 5]])
    trie = CodeTrie.build(codes)
    assert trie.leaves[0].tolist() == [2, 1]
    assert trie.node_of_item[0].tolist() == [0, 0, 1]
    assert trie.node_of_item[1].tolist() == [0, 1, 2]


def test_residual_codes_are_unique_and_follow_clusters():
    rng = np.random.default_rng(1)
    centers = rng.normal(size=(4, 8)) * 10
    cluster = np.repeat(np.arange(4), 50)
    embeddings = centers[cluster] + rng.normal(size=(200, 8)) * 0.1
    codes = residual_codes(embeddings, codebooks=[4, 4], last_size=64, seed=0)
    assert codes.shape == (200, 3)
    assert len(np.unique(codes, axis=0)) == 200
    for c in range(4):  # well-separated clusters land on one first-level code each
        assert len(np.unique(codes[cluster == c, 0])) == 1


def test_build_ids_cli_writes_a_valid_catalog(tiny_dir, tmp_path):
    rng = np.random.default_rng(2)
    emb = tmp_path / "items.parquet"
    pq.write_table(
        pa.table({"item_id": [f"x{i}" for i in range(120)], "embedding": rng.normal(size=(120, 5)).tolist()}), emb
    )
    out = tmp_path / "catalog.parquet"
    result = CliRunner().invoke(app, ["build-ids", str(emb), "--model", str(tiny_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    ranges = semantic_token_ranges(load_tokenizer(tiny_dir))
    catalog = Catalog.load(out, ranges)
    assert len(catalog) == 120 and catalog.levels == 3
