"""The flat prefix trie and semantic-ID building."""

import itertools
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from genrec.catalog import Catalog, CodeTrie
from genrec.catalog.catalog import catalog_version
from genrec.catalog_tools.build_ids import codes_and_codebooks
from genrec.cli import app
from genrec.errors import CatalogError
from genrec.files import write_atomically
from genrec.model.sid_layout import SidLayout
from genrec.model.tokenizer import load_tokenizer
from genrec_bench.reference import allowed_tokens_fn


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
    codes = codes_and_codebooks(embeddings, codebooks=[4, 4], last_size=64, seed=0)[0]
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
    catalog = Catalog.load(out, SidLayout.infer(load_tokenizer(tiny_dir)))
    assert len(catalog) == 120 and catalog.levels == 3


def write_catalog(path, semantic_id, item_id=None):
    item_id = item_id if item_id is not None else pa.array([f"i{n}" for n in range(len(semantic_id))])
    pq.write_table(pa.table({"item_id": item_id, "semantic_id": semantic_id}), path)
    return path


@pytest.mark.parametrize(
    "name, column, fragment",
    [
        ("float codes", lambda c: pa.array((c + 0.7).tolist(), pa.list_(pa.float64())), "list<element: double>"),
        ("string codes", lambda c: pa.array(c.astype(str).tolist(), pa.list_(pa.string())), "list<element: string>"),
        ("plain int column", lambda c: pa.array(c[:, 0]), "not int64"),
        ("null element", lambda c: pa.array([[c[0, 0], None, c[0, 2]], *c[1:].tolist()]), "1 null token ID"),
        ("null row", lambda c: pa.array([None, *c[1:].tolist()], pa.list_(pa.int64())), "null on 1 row"),
        ("empty code", lambda c: pa.array([[], *c[1:].tolist()], pa.list_(pa.int64())), "empty on 1 row"),
        ("proper prefix", lambda c: pa.array([c[1, :2].tolist(), *c[1:].tolist()]), "is a proper prefix of item"),
        ("more levels", lambda c: pa.array([[*c[0], c[0, 2]], *c[1:].tolist()]), "has 4 tokens; this model's"),
        ("token of another level", lambda c: pa.array([c[0, ::-1].tolist(), *c[1:].tolist()]), "not level 0"),
    ],
)
def test_bad_semantic_id_column_names_file_and_column(engine, tmp_path, name, column, fragment):
    layout = engine.family.layout
    path = write_catalog(tmp_path / "catalog.parquet", column(engine.catalog.codes[:4]))
    with pytest.raises(CatalogError) as info:
        Catalog.load(path, layout)
    message = str(info.value)
    assert str(path) in message and "'semantic_id'" in message and fragment in message, (name, message)


@pytest.mark.parametrize("item_id", [pa.array([1, 2, 3, 4]), pa.array(["a", None, "c", "d"])])
def test_bad_item_id_column_names_file_and_column(engine, tmp_path, item_id):
    path = write_catalog(tmp_path / "catalog.parquet", pa.array(engine.catalog.codes[:4].tolist()), item_id)
    with pytest.raises(CatalogError, match=r"catalog\.parquet: column 'item_id'"):
        Catalog.load(path, engine.family.layout)


def test_catalog_of_any_integer_list_type_loads(engine, tmp_path):
    codes = engine.catalog.codes[:4]
    column = pa.array(codes.tolist(), pa.list_(pa.uint16(), 3))  # fixed-size list of unsigned ints
    catalog = Catalog.load(write_catalog(tmp_path / "catalog.parquet", column), engine.family.layout)
    assert catalog.codes.dtype == np.int64 and (catalog.codes == codes).all()


def test_a_catalog_is_labelled_with_the_version_of_the_bytes_it_parsed_while_the_file_is_replaced(engine, tmp_path):
    """An operator's atomic rewrites race the loads: each loaded catalog holds exactly the items of the version it
    names (it hashed one file's bytes and parsed another's before)."""
    codes = engine.catalog.codes[:60].tolist()
    versions = {}
    for k, (lo, hi) in enumerate([(0, 40), (20, 60), (10, 50)]):
        draft = write_catalog(tmp_path / f"draft-{k}.parquet", pa.array(codes[lo:hi]), pa.array(
            [f"i{n}" for n in range(lo, hi)]))  # fmt: skip
        versions[catalog_version(draft)] = ({f"i{n}" for n in range(lo, hi)}, draft.read_bytes())
    live, stop = tmp_path / "catalog.parquet", threading.Event()
    write_atomically(live, next(iter(versions.values()))[1])

    def operator():
        for k in itertools.cycle(range(3)):
            if stop.is_set():
                return
            write_atomically(live, list(versions.values())[k][1])

    rewriting = threading.Thread(target=operator)
    rewriting.start()
    try:
        deadline, loads = time.monotonic() + 2.0, 0
        while time.monotonic() < deadline:
            catalog = Catalog.load(live, engine.family.layout)
            assert set(catalog.item_ids) == versions[catalog.version][0]
            loads += 1
    finally:
        stop.set()
        rewriting.join()
    assert loads > 50


@pytest.mark.parametrize("column", ["item_id", "genre"])
def test_text_that_is_not_utf8_is_refused_at_load(engine, tmp_path, column):
    """A flipped byte in a text column (an item ID, an attribute's value) is refused when the file is loaded, not by
    each later request that reads it (a filter on the attribute answered a bare UnicodeDecodeError, a 500)."""
    codes = engine.catalog.codes[:4].tolist()
    table = pa.table({"item_id": ["i0", "i1", "i2", "i3"], "semantic_id": codes, "genre": ["drama"] * 4})
    pq.write_table(table, tmp_path / "good.parquet", compression="none", use_dictionary=False)
    data = bytearray((tmp_path / "good.parquet").read_bytes())
    text = b"drama" if column == "genre" else b"i2"
    at = data.find(text)
    while at >= 0:  # in the values and the column's statistics alike
        data[at + 1] = 0xC3  # the start of a two-byte sequence, followed by an ASCII byte: not UTF-8
        at = data.find(text, at + 1)
    (tmp_path / "bad.parquet").write_bytes(bytes(data))
    with pytest.raises(CatalogError, match=r"bad\.parquet: not a readable Parquet file .*UTF8"):
        Catalog.load(tmp_path / "bad.parquet", engine.family.layout)


def test_catalog_path_that_is_a_directory(tmp_path):
    with pytest.raises(CatalogError, match="is a directory"):
        Catalog.load(tmp_path)


def test_in_memory_float_codes_are_refused_not_truncated():
    with pytest.raises(CatalogError, match="integer token IDs"):
        Catalog.validated(np.array(["a", "b"], dtype=object), np.array([[1.5, 2.0], [3.0, 4.0]]), None)


def test_trie_of_codes_with_endings_shared_codes_and_popularity():
    """Codes of 1-3 tokens plus a 1-token ending, one code named by three items: leaves are codes, finished codes
    pad with free steps, a shared code's items come by popularity (ties in row order)."""
    pad, end = -1, 99
    codes = np.array([[10, 20, 30], [10, 20, pad], [11, pad, pad], [10, 20, 30], [10, 20, 30]])
    lengths = np.array([3, 2, 1, 3, 3])
    trie = CodeTrie.build(codes, lengths=lengths, ending=(end,), popularity=[1.0, 5.0, 0.0, 2.0, 2.0])
    assert trie.levels == 4 and trie.codes == 3
    allowed = allowed_tokens_fn([[10, 20, 30, end], [10, 20, end], [11, end]])
    frontier, prefixes = torch.zeros(1, dtype=torch.int64), [()]
    for level in range(trie.levels):
        token, child, valid = trie.children(level, frontier)
        free = trie.free[level]
        next_frontier, next_prefixes = [], []
        for row, prefix in enumerate(prefixes):
            kids, tokens = child[row][valid[row]], token[row][valid[row]].tolist()
            finished = bool(prefix) and prefix[-1] == end
            assert (free is not None and free[kids].all().item()) if finished else tokens == allowed(list(prefix))
            next_frontier += kids.tolist()
            next_prefixes += [prefix] if finished else [(*prefix, t) for t in tokens]
        frontier, prefixes = torch.tensor(next_frontier), next_prefixes
    items = {prefixes[k]: trie.items_of(int(code)).tolist() for k, code in enumerate(frontier)}
    assert items == {(10, 20, 30, end): [3, 4, 0], (10, 20, end): [1], (11, end): [2]}


def test_catalog_round_trip_of_ragged_codes_popularity_and_attributes(tmp_path):
    path = tmp_path / "catalog.parquet"
    table = pa.table(
        {
            "item_id": ["a", "b", "c"],
            "semantic_id": [[1, 2, 3], [1, 2], [1, 2, 3]],
            "popularity": [3, 1, 7],
            "genre": ["x", "y", "z"],  # an item attribute: ignored, never refused
        }
    )
    pq.write_table(table, path)
    catalog = Catalog.load(path)
    assert catalog.code(1) == [1, 2] and catalog.lengths.tolist() == [3, 2, 3]
    catalog.save(tmp_path / "again.parquet")
    again = Catalog.load(tmp_path / "again.parquet")
    assert [again.code(i) for i in range(3)] == [[1, 2, 3], [1, 2], [1, 2, 3]]
    assert again.popularity.tolist() == [3.0, 1.0, 7.0]
    pq.write_table(table.set_column(2, "popularity", pa.array([3.0, None, 1.0])), path)
    with pytest.raises(CatalogError, match="column 'popularity', item 'b': null or not finite"):
        Catalog.load(path)


def test_save_then_load_keeps_codes_of_every_length_and_popularity(tmp_path):
    from genrec.catalog.catalog import Catalog

    codes = [[5, 6, 7], [5, 6], [9], [5, 8, 1]]
    catalog = Catalog.validated(["a", "b", "c", "d"], codes, popularity=[1.0, 3.0, 2.0, 0.5])
    catalog.save(tmp_path / "c.parquet")
    again = Catalog.load(tmp_path / "c.parquet")
    assert [again.code(i) for i in range(4)] == codes and again.item_ids.tolist() == ["a", "b", "c", "d"]
    assert again.popularity.tolist() == [1.0, 3.0, 2.0, 0.5]


def test_the_bytes_a_catalog_parses_are_handed_to_arrow_as_its_own_memory(engine, tiny_dir, tmp_path, monkeypatch):
    """Arrow may free the buffer it parsed on one of its threads, late: a buffer over Python bytes then takes the GIL
    while the interpreter exits, and the process aborts ("terminate called without an active exception": `genrec
    deploy` refusing a truncated catalog exited -6 about once in 30 runs on a loaded machine)."""
    handed = []
    reader = pa.BufferReader
    monkeypatch.setattr(pa, "BufferReader", lambda buffer: handed.append(buffer) or reader(buffer))
    good = (tiny_dir / "genrec/catalog.parquet").read_bytes()
    Catalog.load(tmp_path / "good.parquet", engine.family.layout, data=good)
    with pytest.raises(CatalogError, match="not a readable Parquet file"):
        Catalog.load(tmp_path / "cut.parquet", data=good[:100])
    assert [len(buffer) for buffer in handed] == [len(good), 100]
    for buffer, data in zip(handed, [good, good[:100]], strict=True):
        assert isinstance(buffer, pa.Buffer) and buffer.to_pybytes() == data
        assert buffer.address != pa.py_buffer(data).address  # a copy, not a view of the Python object
