"""`genrec catalog import`: each format read into genrec's catalog with the token IDs its names / indexes / raw IDs
mean, every bad code named by row and item, the catalog written atomically."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from genrec.catalog_tools.importers import detect_format, import_catalog, write_layout_preset
from genrec.errors import CatalogError, ModelDirectoryError
from genrec.testing.open_layouts import write_sidgr_jsonl
from tests.open_checkpoints import fresh_copy
from tests.test_cli_errors import run_main


def catalog_rows(model_dir):
    return pq.read_table(model_dir / "genrec" / "catalog.parquet").to_pylist()


def expected_codes(checkpoint):
    """item ID -> token IDs, from the token names the writer used (independent of the importer's mapping)."""
    tok = AutoTokenizer.from_pretrained(str(checkpoint.model_dir))
    return {item: tok.convert_tokens_to_ids(names) for item, names in checkpoint.codes.items()}


@pytest.fixture
def oo(openonerec, tmp_path):
    return fresh_copy(openonerec, tmp_path)


@pytest.fixture
def mo(minionerec, tmp_path):
    model_dir, item_map = fresh_copy(minionerec, tmp_path)
    write_layout_preset(model_dir, "minionerec")
    return model_dir, item_map


def test_pid2sid_indexes_become_the_layouts_token_ids_shared_codes_kept(openonerec, oo):
    model_dir, item_map = oo
    summary = import_catalog(model_dir, item_map)
    rows = catalog_rows(model_dir)
    assert summary.format == "pid2sid" and summary.items == len(rows) == len(openonerec.codes)
    assert {r["item_id"]: r["semantic_id"] for r in rows} == expected_codes(openonerec)
    assert [r["item_id"] for r in rows] == [str(p) for p in pq.read_table(item_map).column("pid").to_pylist()]
    assert summary.shared_codes > 0 and summary.codes < summary.items


def test_index_json_names_become_token_ids_codes_of_three_and_four_tokens(minionerec, mo):
    model_dir, item_map = mo
    summary = import_catalog(model_dir, item_map)
    assert summary.format == "index-json" and set(summary.code_lengths) == {3, 4}
    assert {r["item_id"]: r["semantic_id"] for r in catalog_rows(model_dir)} == expected_codes(minionerec)


def test_jsonl_raw_token_ids_and_popularity_and_genrec_round_trip(openonerec, oo):
    model_dir, item_map = oo
    import_catalog(model_dir, item_map)
    rows = catalog_rows(model_dir)
    jsonl = write_sidgr_jsonl(model_dir.parent / "catalog.jsonl", [(r["item_id"], r["semantic_id"]) for r in rows])
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    for n, line in enumerate(lines):
        line["metadata"]["popularity"] = n % 7
    jsonl.write_text("\n".join(json.dumps(line) for line in lines))
    summary = import_catalog(model_dir, jsonl)  # the model has a catalog now: this is a new version beside it
    assert summary.catalog == model_dir / "genrec" / f"catalog-{summary.catalog_version[:12]}.parquet"
    assert catalog_rows(model_dir) == rows  # the model's own catalog untouched
    again = pq.read_table(summary.catalog).to_pylist()
    assert summary.format == "jsonl"
    assert [(r["item_id"], r["semantic_id"]) for r in again] == [(r["item_id"], r["semantic_id"]) for r in rows]
    assert [r["popularity"] for r in again] == [float(n % 7) for n in range(len(rows))]

    own = model_dir.parent / "mine.parquet"
    table = pq.read_table(summary.catalog).append_column("genre", pa.array(["x"] * len(rows)))
    pq.write_table(table, own)
    summary = import_catalog(model_dir, own, in_place=True)  # replaces the model's own (untrained) catalog
    assert summary.format == "genrec" and summary.catalog == model_dir / "genrec" / "catalog.parquet"
    assert catalog_rows(model_dir) == [{**r, "genre": "x"} for r in again]  # attributes carried over, not refused


def test_wrapped_codes_are_stored_without_their_wrappers(openonerec, minionerec, oo, mo):
    model_dir, item_map = oo
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    begin, end = tok.convert_tokens_to_ids(["<|sid_begin|>", "<|sid_end|>"])
    codes = expected_codes(openonerec)
    wrapped = [(i, [begin, *c, end] if n % 3 else c) for n, (i, c) in enumerate(codes.items())]  # some bare
    import_catalog(model_dir, write_sidgr_jsonl(model_dir.parent / "c.jsonl", wrapped))
    assert {r["item_id"]: r["semantic_id"] for r in catalog_rows(model_dir)} == codes

    model_dir, _ = mo
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ending = [*tok("\n", add_special_tokens=False)["input_ids"], tok.eos_token_id]
    codes = expected_codes(minionerec)
    ended = [(i, [*c, *ending] if n % 2 else c) for n, (i, c) in enumerate(codes.items())]  # 3 or 4 tokens, then \n EOS
    summary = import_catalog(model_dir, write_sidgr_jsonl(model_dir.parent / "m.jsonl", ended))
    assert {r["item_id"]: r["semantic_id"] for r in catalog_rows(model_dir)} == codes
    assert set(summary.code_lengths) == {3, 4}


def test_format_is_told_from_name_and_contents_and_can_be_forced(oo, mo, tmp_path):
    assert detect_format(oo[1]) == "pid2sid"
    assert detect_format(mo[1]) == "index-json"
    unnamed = tmp_path / "map.json"
    unnamed.write_text(mo[1].read_text())
    assert detect_format(unnamed) == "index-json"
    lines = tmp_path / "catalog.txt"
    write_sidgr_jsonl(lines, [("x", [1, 2])])
    assert detect_format(lines) == "jsonl"
    with pytest.raises(CatalogError, match="--format"):
        detect_format(_write(tmp_path / "x.csv", "item,code\n"))
    with pytest.raises(CatalogError, match="not a readable Parquet file"):
        detect_format(_write(tmp_path / "broken.parquet", "PAR1 and nothing else"))
    with pytest.raises(CatalogError, match="no such file"):
        import_catalog(oo[0], tmp_path / "missing.jsonl", "jsonl")
    with pytest.raises(CatalogError, match="unknown format 'csv'"):
        import_catalog(oo[0], oo[1], "csv")
    with pytest.raises(CatalogError, match="column 'item_id' is missing"):
        import_catalog(oo[0], oo[1], "genrec")


def _write(path, text):
    path.write_text(text)
    return path


def _index(path, body):
    return _write(path, json.dumps(body))


def _bad_index(mo, tmp_path, change):
    body = json.loads(mo[1].read_text())
    change(body)
    return _index(tmp_path / f"bad-{len(list(tmp_path.iterdir()))}.index.json", body)


def _jsonl(tmp_path, rows):
    return write_sidgr_jsonl(tmp_path / f"bad-{len(list(tmp_path.iterdir()))}.jsonl", rows)


def test_import_errors_name_row_and_item(oo, mo, tmp_path):
    model_dir, item_map = oo
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    a0, b0, c0, begin = tok.convert_tokens_to_ids(["<s_a_0>", "<s_b_0>", "<s_c_0>", "<|sid_begin|>"])
    table = pq.read_table(item_map)
    sids = table.column("sid").to_pylist()
    sids[4] = [sids[4][0], 99, sids[4][2]]
    out_of_range = tmp_path / "pid2sid.parquet"
    pq.write_table(table.set_column(1, "sid", pa.array(sids)), out_of_range)
    cases = [
        (model_dir, out_of_range, "row 5 (item '1004'): sid[1] = 99 is not a code of level 1 (it has 16 codes)"),
        (model_dir, _jsonl(tmp_path, [("x", [a0, b0, c0]), ("y", [b0, a0])]), "row 2 (item 'y'): token"),
        (model_dir, _jsonl(tmp_path, [("x", [a0, b0, c0]), ("x", [a0, b0])]), "row 2 (item 'x'): duplicate item ID"),
        (model_dir, _jsonl(tmp_path, [("x", [a0, b0, c0, a0])]), "row 1 (item 'x'): the code has 4 tokens"),
        (model_dir, _jsonl(tmp_path, [("x", [a0, 7])]), "row 1 (item 'x'): token 7 at position 1 is not a semantic"),
        (model_dir, _jsonl(tmp_path, [("x", [a0, begin])]), "row 1 (item 'x'): token"),
        (model_dir, _jsonl(tmp_path, [("x", [a0, 10**6])]), "row 1 (item 'x'): token ID 1000000 is outside"),
        (model_dir, _jsonl(tmp_path, [("x", [])]), "row 1 (item 'x'): token_ids must be a non-empty list"),
        (
            mo[0],
            _bad_index(mo, tmp_path, lambda b: b["3"].__setitem__(1, "<b_999>")),
            "row 4 (item '3'): token '<b_999>'",
        ),
        (mo[0], _bad_index(mo, tmp_path, lambda b: b.__setitem__("7", [])), "row 8 (item '7'): the code must be"),
    ]
    for directory, source, fragment in cases:
        with pytest.raises(CatalogError) as info:
            import_catalog(directory, source)
        assert fragment in str(info.value), (fragment, str(info.value))
        assert str(source) in str(info.value)


def test_a_failed_import_leaves_the_catalog_as_it_was(oo, tmp_path):
    model_dir, item_map = oo
    import_catalog(model_dir, item_map)
    before = (model_dir / "genrec" / "catalog.parquet").read_bytes()
    with pytest.raises(CatalogError):
        import_catalog(model_dir, _jsonl(tmp_path, [("x", [1, 2])]))
    assert (model_dir / "genrec" / "catalog.parquet").read_bytes() == before
    assert sorted(p.name for p in (model_dir / "genrec").iterdir()) == ["catalog.parquet"]  # no temporary left


def test_more_bad_sources_are_named(oo, mo, tmp_path):
    """A pid2sid code shorter than the layout, an index.json item key given twice (JSON would keep its last code),
    and a token ID beyond int64 are each one error naming the file (and the row)."""
    model_dir, item_map = oo
    table = pq.read_table(item_map)
    sids = table.column("sid").to_pylist()
    short, huge = tmp_path / "short.parquet", tmp_path / "huge.parquet"
    pq.write_table(table.set_column(1, "sid", pa.array([*sids[:2], sids[2][:2], *sids[3:]])), short)
    as_uint = pa.array([[2**63 + 5, 0, 0], *sids[1:]], pa.list_(pa.uint64()))
    pq.write_table(table.set_column(1, "sid", as_uint), huge)
    text = mo[1].read_text().rstrip().removesuffix("}") + ', "0": ["<a_0>"]}'
    repeated = tmp_path / "repeated.index.json"
    repeated.write_text(text)
    cases = [
        (model_dir, short, "row 3 (item '1002'): sid has 2 levels; the layout has 3"),
        (model_dir, huge, "column 'sid' holds an integer outside int64"),
        (
            mo[0],
            repeated,
            f"row {len(json.loads(mo[1].read_text())) + 1} (item '0'): duplicate item ID (first on row 1)",
        ),
    ]
    for directory, source, fragment in cases:
        with pytest.raises(CatalogError) as info:
            import_catalog(directory, source)
        assert fragment in str(info.value) and str(source) in str(info.value), str(info.value)


def test_a_failed_import_with_a_preset_writes_neither_file(minionerec, tmp_path):
    """The preset's layout checks the codes; sid_layout.json is written only with the catalog, after it."""
    model_dir, item_map = fresh_copy(minionerec, tmp_path)
    bad = _bad_index((model_dir, item_map), tmp_path, lambda b: b["3"].__setitem__(1, "<zz>"))
    with pytest.raises(CatalogError, match="row 4"):
        import_catalog(model_dir, bad, layout_preset="minionerec")
    assert not (model_dir / "genrec").exists()
    summary = import_catalog(model_dir, item_map, layout_preset="minionerec")
    assert summary.warning is None and set(summary.code_lengths) == {3, 4}
    assert json.loads((model_dir / "genrec" / "sid_layout.json").read_text())["preset"] == "minionerec"


def test_codes_of_several_lengths_without_an_ending_are_warned_of(minionerec, tmp_path):
    model_dir, item_map = fresh_copy(minionerec, tmp_path)  # MiniOneRec without --layout reads as genrec's
    summary = import_catalog(model_dir, item_map)
    assert summary.warning is not None and "--layout minionerec" in summary.warning


def test_layout_preset_is_written_once_and_a_different_one_refused(mo):
    model_dir, _ = mo
    assert write_layout_preset(model_dir, "minionerec").read_text().strip() == '{"version": 1, "preset": "minionerec"}'
    with pytest.raises(ModelDirectoryError, match="already says something else"):
        write_layout_preset(model_dir, "openonerec")
    with pytest.raises(ModelDirectoryError, match="preset 'lcrec' is not one of"):
        write_layout_preset(model_dir, "lcrec")


def test_cli_imports_and_reports_and_refuses_by_name(openonerec, minionerec, tmp_path, monkeypatch, capsys):
    from genrec.cli import main

    model_dir, item_map = fresh_copy(minionerec, tmp_path)
    monkeypatch.setattr(
        "sys.argv", ["genrec", "catalog", "import", str(model_dir), str(item_map), "--layout", "minionerec"]
    )
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["format"] == "index-json" and summary["items"] == len(minionerec.codes)
    assert json.loads((model_dir / "genrec" / "sid_layout.json").read_text())["preset"] == "minionerec"

    bad = _jsonl(tmp_path, [("x", [1, 2])])
    err = run_main(monkeypatch, capsys, "catalog", "import", openonerec.model_dir, bad, "--format", "jsonl")
    assert "error:" in err and "row 1 (item 'x')" in err
    assert not (openonerec.model_dir / "genrec").exists()  # the shared checkpoint was not written
