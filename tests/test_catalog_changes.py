"""`genrec catalog add` / `retire`: new items coded with build-ids' codebooks, items removed, without retraining."""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from genrec.api import RetrieveRequest
from genrec.catalog import Catalog
from genrec.catalog_tools.build_ids import codes_and_codebooks
from genrec.catalog_tools.changes import add_items, new_codes, read_item_list, retire_items
from genrec.catalog_tools.codebooks import Codebooks
from genrec.cli import app
from genrec.errors import CatalogError, GenrecError
from genrec.model.directory import ModelDir

BUILT, ADDED, DIM = 120, 30, 6  # the conftest model: 3 levels of 8 codes


def _items(path, ids, vectors):
    pq.write_table(pa.table({"item_id": list(ids), "embedding": np.asarray(vectors).tolist()}), path)
    return path


def _run(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result


@pytest.fixture
def built(tiny_dir, tmp_path):
    """A copy of the tiny model whose catalog `genrec build-ids` wrote from BUILT + ADDED items; the embeddings."""
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    vectors = np.random.default_rng(7).normal(size=(BUILT + ADDED, DIM))
    ids = [f"x{i}" for i in range(BUILT + ADDED)]
    result = _run("build-ids", _items(tmp_path / "all.parquet", ids, vectors), "--model", model)
    assert result.exit_code == 0, result.output
    return model, ids, vectors


def _catalog(model):
    directory = ModelDir.open(model)
    return directory.load_catalog()


def _nearest_codes(codebooks, embeddings) -> np.ndarray:
    """[n, levels-1] code indices: at each level the nearest center to the residual the levels above left (what
    build-ids gives an item unless its nearest prefix was full)."""
    residual = torch.as_tensor(np.asarray(embeddings, dtype=np.float32)) / codebooks.scale
    columns = []
    for centers in codebooks.centers:
        assign = torch.cdist(residual, centers).argmin(dim=1)
        residual = residual - centers[assign]
        columns.append(assign.numpy())
    return np.stack(columns, axis=1).astype(np.int64)


def _numpy_nearest(embeddings, scale, centers):
    """The plain reference: squared distances to every center, argmin, subtract, level by level."""
    residual, out = np.asarray(embeddings, dtype=np.float64) / scale, []
    for c in centers:
        c = np.asarray(c, dtype=np.float64)
        nearest = ((residual[:, None, :] - c[None, :, :]) ** 2).sum(axis=2).argmin(axis=1)
        residual = residual - c[nearest]
        out.append(nearest)
    return np.stack(out, axis=1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nearest_codes_equal_a_numpy_reference(seed):
    rng = np.random.default_rng(seed)
    centers = tuple(torch.tensor(rng.normal(size=(k, 5)), dtype=torch.float32) for k in (16, 7, 9))
    codebooks = Codebooks(3.5, centers, 4)
    embeddings = rng.normal(size=(400, 5)).astype(np.float32) * 3
    got = _nearest_codes(codebooks, embeddings)
    want = _numpy_nearest(embeddings, 3.5, [c.numpy() for c in centers])
    assert (got == want).all()


def test_codebooks_reproduce_build_ids_where_no_prefix_was_full():
    """Re-coding the build set with its own codebooks gives build-ids' prefixes except where capacity moved an
    item (then build-ids' choice was not the nearest one)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(300, 8))
    codes, codebooks = codes_and_codebooks(x, [8, 8], 8, seed=0)
    again = _nearest_codes(codebooks, x)
    same = (again == codes[:, :2]).all(axis=1)
    assert same.mean() > 0.9  # most items were not moved: the comparison below is not vacuous
    scaled = torch.tensor(x, dtype=torch.float32) / codebooks.scale
    for row in np.flatnonzero(~same):  # a moved item: its nearest first or second level was full in build-ids
        moved_first = codes[row, 0] != again[row, 0]
        level = 0 if moved_first else 1
        residual = scaled[row] if moved_first else scaled[row] - codebooks.centers[0][codes[row, 0]]
        distances = torch.cdist(residual[None], codebooks.centers[level])[0]
        assert distances[codes[row, level]] >= distances[again[row, level]]


def _change(*args) -> dict:
    result = _run(*args)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_retired_items_added_back_get_build_ids_codes(built, tmp_path):
    """The last ADDED rows of the build, retired then added back: where build-ids put each on its nearest
    prefix, the whole code is build-ids' (the first free last-level index is the one it numbered them). Each change
    is a new file named by its hash beside the model's catalog, which stays as it was."""
    model, ids, vectors = built
    original, original_file = _catalog(model), (model / "genrec/catalog.parquet").read_bytes()
    retired = _change("catalog", "retire", model, "--items", ",".join(ids[BUILT:]))
    assert len(Catalog.load(retired["catalog"])) == BUILT
    new_items = _items(tmp_path / "new.parquet", ids[BUILT:], vectors[BUILT:])
    summary = _change("catalog", "add", model, new_items, "--catalog", retired["catalog"])
    for change in (retired, summary):
        digest = hashlib.sha256(open(change["catalog"], "rb").read()).hexdigest()
        assert change["catalog_version"] == digest[:16]
        assert change["catalog"] == str(model / "genrec" / f"catalog-{digest[:12]}.parquet")
    assert (model / "genrec/catalog.parquet").read_bytes() == original_file
    catalog = Catalog.load(summary["catalog"])
    assert summary["added"] == ADDED and summary["items"] == BUILT + ADDED == len(catalog)
    assert catalog.item_ids.tolist() == ids  # existing rows first and unchanged, new rows appended
    assert (catalog.codes[:BUILT] == original.codes[:BUILT]).all()
    assert len(np.unique(catalog.codes, axis=0)) == len(catalog)
    codebooks, _ = Codebooks.load(model / "genrec/codebooks.safetensors")
    layout = ModelDir.open(model).load_sid_layout()
    nearest = np.stack(
        [layout.level_ids[level][_nearest_codes(codebooks, vectors)[:, level]] for level in range(2)], axis=1
    )
    unmoved = (nearest == original.codes[:, :2]).all(axis=1)
    assert unmoved.all()  # this catalog had room everywhere: so the codes must be build-ids' exactly
    assert (catalog.codes[BUILT:] == original.codes[BUILT:]).all()
    # the same content again is the same file: written over itself, not refused
    assert _change("catalog", "add", model, new_items, "--catalog", retired["catalog"]) == summary


def _ranges_layout(*sizes):
    """Level l's codes are consecutive token IDs after level l-1's, from 0."""
    from genrec.model.sid_layout import SidLayout

    starts = np.cumsum([0, *sizes[:-1]])
    ids = tuple(np.arange(s, s + k) for s, k in zip(starts, sizes, strict=True))
    return SidLayout(level_ids=ids, level_indices=tuple(np.arange(k) for k in sizes))


def test_new_items_take_the_first_free_last_level_code_and_the_next_nearest_prefix_when_theirs_is_full():
    layout = _ranges_layout(4, 4, 4)  # token IDs 0-3, 4-7, 8-11
    codebooks = Codebooks(1.0, (torch.eye(4, dtype=torch.float32), torch.eye(4, dtype=torch.float32)), 4)
    held = [[0, 4, 8], [0, 4, 9], [0, 4, 11], [1, 4, 8]]  # prefix (0, 4) holds last-level indices 0, 1, 3
    catalog = Catalog.validated(np.array(["a", "b", "c", "d"], dtype=object), np.array(held), layout)
    new = np.array([[0, 0, 1.0, 0], [1.0, 0, 0, 0], [0, 0, 0.8, 0]])  # on prefixes (2, 4), (0, 4), (2, 4)
    codes = new_codes(catalog, layout, codebooks, new, ["n0", "n1", "n2"], "new.parquet")
    assert codes.tolist() == [[2, 4, 8], [0, 4, 10], [2, 4, 9]]  # the gap at index 2; a new prefix from 0, in order
    # Both nearest (0, 4), which has one free code, not two: the farther from its center (m1: residual 0.42 away
    # against 0.1) takes its next nearest second-level center, (0, 6): build-ids' balanced rule
    two_more = np.array([[1.9, 0, 0, 0], [1.7, 0, 0.3, 0]])
    codes = new_codes(catalog, layout, codebooks, two_more, ["m0", "m1"], "new.parquet")
    assert codes.tolist() == [[0, 4, 10], [0, 6, 8]]


def test_an_item_with_no_free_code_anywhere_is_refused_naming_it():
    layout = _ranges_layout(2, 2, 2)  # 8 codes
    codebooks = Codebooks(1.0, (torch.eye(2, dtype=torch.float32), torch.eye(2, dtype=torch.float32)), 2)
    held = [[a, 2 + b, 4 + c] for a in range(2) for b in range(2) for c in range(2)][:7]
    catalog = Catalog.validated(np.array([f"h{k}" for k in range(7)], dtype=object), np.array(held), layout)
    new = np.array([[1.0, 0.0], [0.0, 1.0]])  # m0 nearest the full prefix 0; m1 on prefix 1, which has one code left
    assert new_codes(catalog, layout, codebooks, new[:1], ["m0"], "x").tolist() == [[1, 3, 5]]  # the one free
    with pytest.raises(CatalogError, match=r"x: row 1 \(item 'm0'\): every code under its level-0 prefix is taken"):
        new_codes(catalog, layout, codebooks, new, ["m0", "m1"], "x")


def _plain_codes_with_room(new, centers, last_size, held_codes, item_count):
    """The reference: level by level, every item's nearest center; then, while a prefix is wanted by more items
    than it has free codes, its farthest (then latest) items give it up for their next nearest; then the last
    level's first free index in row order. Plain loops and dicts."""
    sizes = [len(c) for c in centers] + [last_size]
    residual = [np.asarray(row, dtype=np.float64) for row in new]
    prefixes = [() for _ in new]
    for level, level_centers in enumerate(centers):
        capacity = int(np.prod(sizes[level + 1 :]))
        held_under = {}
        for code in held_codes:
            held_under[tuple(code[: level + 1])] = held_under.get(tuple(code[: level + 1]), 0) + 1
        dist = [[float(np.linalg.norm(r - c)) for c in level_centers] for r in residual]
        banned = [set() for _ in new]
        choice = [min((d, c) for c, d in enumerate(dist[r]))[1] for r in range(len(new))]
        while True:
            groups = {}
            for r in range(len(new)):
                if choice[r] is not None:
                    groups.setdefault(prefixes[r] + (choice[r],), []).append(r)
            moved = False
            for key, rows in groups.items():
                rows.sort(key=lambda r: (dist[r][key[-1]], r))
                for r in rows[max(capacity - held_under.get(key, 0), 0) :]:
                    banned[r].add(choice[r])
                    left = [(d, c) for c, d in enumerate(dist[r]) if c not in banned[r]]
                    choice[r] = min(left)[1] if left else None
                    moved = True
            if not moved:
                break
        for r in range(len(new)):
            if choice[r] is None:
                return f"row {r + 1} (item 'n{r}')"
            residual[r] = residual[r] - level_centers[choice[r]]
            prefixes[r] = prefixes[r] + (choice[r],)
    taken = {}
    for code in held_codes:
        taken.setdefault(tuple(code[:-1]), set()).add(code[-1])
    out = []
    for prefix in prefixes:
        free = [c for c in range(last_size) if c not in taken.setdefault(prefix, set())]
        taken[prefix].add(free[0])
        out.append([*prefix, free[0]])
    return out


@pytest.mark.parametrize(("seed", "held"), [(0, 10), (1, 10), (2, 20), (3, 20), (0, 40), (1, 45), (2, 50)])
def test_codes_equal_a_plain_reference_of_the_room_rule(seed, held):
    """Random catalogs with gaps and random new items, some wanting full prefixes: the vectorised rule against
    plain loops (levels of 3, 3 and 6 codes: 54 in all)."""
    rng = np.random.default_rng(seed)
    layout = _ranges_layout(3, 3, 6)  # token IDs 0-2, 3-5, 6-11
    all_codes = np.array([[a, b, c] for a in range(3) for b in range(3) for c in range(6)])
    held_codes = all_codes[rng.choice(len(all_codes), size=held, replace=False)]
    tokens = held_codes + np.array([0, 3, 6])
    catalog = Catalog.validated(np.array([f"i{n}" for n in range(held)], dtype=object), tokens, layout)
    centers = (torch.tensor(rng.normal(size=(3, 4)), dtype=torch.float32),) * 2
    new = rng.normal(size=(12, 4)).astype(np.float32)
    want = _plain_codes_with_room(new, [c.double().numpy() for c in centers], 6, held_codes.tolist(), 12)
    try:
        got = new_codes(catalog, layout, Codebooks(1.0, centers, 6), new, [f"n{n}" for n in range(12)], "x")
    except CatalogError as err:
        got = err
    if isinstance(want, str):
        assert isinstance(got, CatalogError) and want in str(got)
    else:
        assert not isinstance(got, CatalogError), got
        assert (got - np.array([0, 3, 6])).tolist() == want


def test_the_engine_retrieves_added_items(built, tmp_path):
    """Items added to a built catalog come out of a full-width beam (every catalog item is a beam)."""
    from genrec.engine import Engine, SchedulerConfig

    model, ids, vectors = built
    assert _run("catalog", "retire", model, "--items", ",".join(ids[BUILT:]), "--in-place").exit_code == 0
    fresh = [f"new{i}" for i in range(ADDED)]
    moved = vectors[BUILT:] + np.random.default_rng(8).normal(size=(ADDED, DIM)) * 0.3  # not the build's points
    result = _run("catalog", "add", model, _items(tmp_path / "new.parquet", fresh, moved), "--in-place")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (model / "genrec").glob("catalog*")) == ["catalog.parquet"]  # rewritten in place
    engine = Engine.from_pretrained(model, scheduler=SchedulerConfig(prefix_cache_bytes=0))
    assert len(engine.catalog) == BUILT + ADDED
    (found,) = engine.retrieve([RetrieveRequest(prompt_token_ids=[5, 6, 7], beam_width=len(engine.catalog))])
    returned = [item.item_id for item in found.items]
    assert sorted(returned) == sorted(ids[:BUILT] + fresh)
    assert len(np.unique(engine.catalog.codes, axis=0)) == len(engine.catalog)
    nearest = _nearest_codes(Codebooks.load(model / "genrec/codebooks.safetensors")[0], moved)
    layout = ModelDir.open(model).load_sid_layout()
    prefixes = np.stack([layout.level_ids[level][nearest[:, level]] for level in range(2)], axis=1)
    assert (engine.catalog.codes[BUILT:, :2] == prefixes).all()  # each on its nearest prefix (room everywhere)


@pytest.mark.parametrize(
    ("rows", "fragment"),
    [
        ({"item_id": ["x3"], "embedding": [[0.0] * DIM]}, r"row 1 \(item 'x3'\): already in the catalog"),
        ({"item_id": ["n", "n"], "embedding": [[0.0] * DIM] * 2}, r"row 2 \(item 'n'\): duplicate item ID"),
        ({"item_id": ["n"], "embedding": [[0.0] * 4]}, r"row 1 \(item 'n'\): column 'embedding' has 4 values; .* 6"),
        ({"item_id": ["n", "m"], "embedding": [[0.0] * DIM, [np.nan] * DIM]}, r"item 'm' \(row 1\) has a non-finite"),
        (
            {"item_id": ["n", "m"], "embedding": [[0.0] * DIM, [0.0, 1.0]]},
            r"another length on row 1 \(item 'm': 2 values",
        ),
    ],
)
def test_bad_new_items_are_refused_naming_the_row(built, tmp_path, rows, fragment):
    model, _, _ = built
    before = (model / "genrec/catalog.parquet").read_bytes()
    source = tmp_path / "new.parquet"
    pq.write_table(pa.table(rows), source)
    with pytest.raises(GenrecError, match=fragment):
        add_items(model, source)
    assert (model / "genrec/catalog.parquet").read_bytes() == before  # nothing written


def test_a_catalog_without_codebooks_cannot_take_new_items(built, tmp_path):
    """An imported catalog (OpenOneRec's, MiniOneRec's, or genrec's own from before codebooks were kept)."""
    model, ids, vectors = built
    (model / "genrec/codebooks.safetensors").unlink()
    source = _items(tmp_path / "new.parquet", ["n"], vectors[:1])
    result = _run("catalog", "add", model, source)
    assert result.exit_code != 0
    with pytest.raises(CatalogError, match=r"codebooks.safetensors: missing: .*`genrec catalog import`.*build-ids"):
        add_items(model, source)


def test_import_onto_a_trained_catalog_keeps_it_and_its_codebooks_unless_forced(built, tmp_path):
    """An import is a new version beside the trained catalog, which `catalog add` refuses (its codes are not the
    codebooks'); replacing the trained catalog needs --in-place and --force, and only that deletes the codebooks."""
    model, ids, vectors = built
    trained, codebooks = (model / "genrec/catalog.parquet").read_bytes(), model / "genrec/codebooks.safetensors"
    source = tmp_path / "other.parquet"
    shutil.copy(model / "genrec/catalog.parquet", source)
    imported = _change("catalog", "import", model, source)
    assert imported["catalog"] == str(model / "genrec" / f"catalog-{imported['catalog_version'][:12]}.parquet")
    assert (model / "genrec/catalog.parquet").read_bytes() == trained and codebooks.is_file()
    retired = retire_items(model, ids[:1], base=imported["catalog"])  # a version of the import is one still
    for base in (imported["catalog"], retired.catalog):
        with pytest.raises(CatalogError, match=r"was imported \(`genrec catalog import`\): its codes were not made"):
            add_items(model, _items(tmp_path / "n.parquet", ["n"], vectors[:1]), base=base)
    for replace in (["--in-place"], ["--out", model / "genrec/catalog.parquet", "--in-place"]):
        result = _run("catalog", "import", model, source, *replace)
        assert (
            result.exit_code != 0
            and "a trained catalog" in str(result.exception)
            and "--force" in str(result.exception)
        )
    assert (model / "genrec/catalog.parquet").read_bytes() == trained and codebooks.is_file()
    forced = _change("catalog", "import", model, source, "--in-place", "--force")
    assert forced["catalog"] == str(model / "genrec/catalog.parquet") and not codebooks.exists()


def test_retire_errors_name_the_items(built, tmp_path):
    model, ids, _ = built
    with pytest.raises(GenrecError, match=r"--items: item 'nope' is not in the catalog \(1 of 2\)"):
        retire_items(model, ["x1", "nope"])
    with pytest.raises(GenrecError, match=r"^--items: retiring all 150 items would leave the catalog empty"):
        retire_items(model, ids)
    (tmp_path / "all.txt").write_text("\n".join(ids))
    result = _run("catalog", "retire", model, "--items-file", tmp_path / "all.txt")
    assert f"--items-file {tmp_path / 'all.txt'}: retiring all 150 items" in str(result.exception)  # was "--items:"
    assert len(_catalog(model)) == BUILT + ADDED


def test_item_lists_from_a_file_or_commas(tmp_path):
    (tmp_path / "ids.txt").write_text("a\n\nb \n")
    pq.write_table(pa.table({"item_id": ["c", "d"]}), tmp_path / "ids.parquet")
    assert read_item_list(None, tmp_path / "ids.txt") == ["a", "b"]
    assert read_item_list(None, str(tmp_path / "ids.parquet")) == ["c", "d"]
    assert read_item_list("e, f,") == ["e", "f"]
    assert read_item_list(str(tmp_path / "ids.txt")) == [str(tmp_path / "ids.txt")]  # --items is never a path
    with pytest.raises(GenrecError, match="names no item"):
        read_item_list(" , ")
    with pytest.raises(GenrecError, match="--items A,B,... or --items-file FILE"):
        read_item_list("a", tmp_path / "ids.txt")
    with pytest.raises(GenrecError, match="--items-file .*nope.txt: no such file"):
        read_item_list(None, tmp_path / "nope.txt")


def test_retire_out_leaves_the_model_catalog_alone(built, tmp_path):
    model, ids, _ = built
    before = (model / "genrec/catalog.parquet").read_bytes()
    out = tmp_path / "elsewhere.parquet"
    result = _run("catalog", "retire", model, "--items", "x0", "--out", out)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {
        "added": 0,
        "retired": 1,
        "items": BUILT + ADDED - 1,
        "catalog": str(out),
        "catalog_version": hashlib.sha256(out.read_bytes()).hexdigest()[:16],
    }
    assert (model / "genrec/catalog.parquet").read_bytes() == before
    assert pq.read_table(out).column("item_id").to_pylist() == ids[1:]
    again = _run("catalog", "retire", model, "--items", "x1", "--out", out)  # out exists now: not rewritten
    assert again.exit_code != 0 and "exists; a catalog is rewritten in place only with --in-place" in str(
        again.exception
    )
    assert pq.read_table(out).column("item_id").to_pylist() == ids[1:]
    assert _run("catalog", "retire", model, "--items", "x1", "--out", out, "--in-place").exit_code == 0
    assert pq.read_table(out).column("item_id").to_pylist() == [ids[0], *ids[2:]]  # the model's catalog less x1


def test_build_ids_writes_the_codebooks_beside_the_catalog_never_in_the_model_root(tiny_dir, tmp_path):
    source = _items(
        tmp_path / "items.parquet", [f"x{i}" for i in range(40)], np.random.default_rng(9).normal(size=(40, 3))
    )
    out = tmp_path / "elsewhere" / "catalog.parquet"
    root_before = sorted(p.name for p in tiny_dir.iterdir())
    assert _run("build-ids", source, "--model", tiny_dir, "--out", out).exit_code == 0
    codebooks, _ = Codebooks.load(out.parent / "codebooks.safetensors")
    assert codebooks.dim == 3 and len(codebooks.centers) == 2 and codebooks.last_size == 8
    assert sorted(p.name for p in tiny_dir.iterdir()) == root_before


def test_versions_kept_apart_from_the_models_catalog(built, tmp_path):
    """--catalog names the version to change and --out the new one: the model's own catalog stays as it was, and
    retired items added back to the retired version get their codes back."""
    model, ids, vectors = built
    original_file = (model / "genrec/catalog.parquet").read_bytes()
    original = _catalog(model)
    retired, back = tmp_path / "v2.parquet", tmp_path / "v3.parquet"
    result = _run("catalog", "retire", model, "--items", ",".join(ids[:5]), "--out", retired)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["catalog"] == str(retired)
    result = _run("catalog", "add", model, _items(tmp_path / "n.parquet", ids[:5], vectors[:5]), "--catalog", retired,
                  "--out", back)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (model / "genrec/catalog.parquet").read_bytes() == original_file
    again = Catalog.load(back)
    assert again.item_ids.tolist() == ids[5:] + ids[:5]  # the retired version's rows, then the added ones
    for item in ids:
        assert again.code(again.index_of(item)) == original.code(original.index_of(item))
    result = _run("catalog", "retire", model, "--items", ids[7], "--catalog", back, "--in-place")
    assert result.exit_code == 0 and Catalog.load(back).index_of(ids[7]) is None
    hashed = Path(_change("catalog", "retire", model, "--items", ids[8], "--catalog", back)["catalog"])
    result = _run("catalog", "retire", model, "--items", ids[9], "--catalog", hashed, "--in-place")
    assert result.exit_code != 0 and f"{hashed}: its name carries the hash {hashed.name[8:20]}" in str(
        result.exception
    )  # a hash-named version is never rewritten: its name would lie


def test_build_ids_writes_over_no_file_and_no_other_catalogs_codebooks(built, tmp_path):
    """Found by a careless-operator probe: --out replaced the model's weights, its own input or a catalog version,
    and --out into MODEL/genrec/ replaced the model catalog's codebooks (every later `catalog add` then coded
    wrongly). Each is refused before anything is built, and nothing is touched."""
    model, ids, vectors = built
    embeddings = _items(tmp_path / "e.parquet", ids, vectors)
    watched = [model / "model.safetensors", embeddings, model / "genrec/catalog.parquet"]
    watched.append(model / "genrec/codebooks.safetensors")
    (tmp_path / "apart").mkdir()
    assert _run("build-ids", embeddings, "--model", model, "--out", tmp_path / "apart/c.parquet").exit_code == 0
    before = [path.read_bytes() for path in watched]
    for out, fragment in (
        (model / "model.safetensors", "exists; build-ids writes a new catalog file"),
        (embeddings, "exists; build-ids writes a new catalog file"),
        (model / "genrec/trial.parquet", "its codebooks would replace those of the model's catalog"),
        (tmp_path / "apart/d.parquet", "codebooks.safetensors is beside it, another catalog's codebooks"),
    ):
        result = _run("build-ids", embeddings, "--model", model, "--out", out)
        assert result.exit_code != 0 and fragment in str(result.exception), (out, result.exception)
    assert [path.read_bytes() for path in watched] == before
    rebuilt = _run("build-ids", embeddings, "--model", model)  # the model's own catalog is rebuilt, as ever
    assert rebuilt.exit_code == 0 and (model / "genrec/catalog.parquet").read_bytes() == before[2]


def test_codebooks_that_did_not_build_a_catalog_code_nothing_into_it(built, tmp_path):
    """Found by the same probe: a build cut between its two writes (or another build's codebooks since) left the
    catalog beside codebooks that did not code it, and `catalog add` coded with them, exit 0. A catalog records its
    codebooks' hash (its versions keep it), and `catalog add` refuses others; a catalog from before is taken."""
    model, ids, vectors = built
    retired = retire_items(model, ids[:3])  # a version keeps the record
    codebooks_file = model / "genrec/codebooks.safetensors"
    codebooks, version = Codebooks.load(codebooks_file)
    assert pq.read_schema(retired.catalog).metadata[b"genrec.codebooks"].decode() == version
    assert add_items(model, _items(tmp_path / "back.parquet", ids[:3], vectors[:3]), base=retired.catalog).added == 3
    other = Codebooks(codebooks.scale * 2, codebooks.centers, codebooks.last_size)
    other.save(codebooks_file)  # as an interrupted or a concurrent build leaves them
    new = _items(tmp_path / "n.parquet", ["n"], vectors[:1])
    for base in (None, retired.catalog):
        with pytest.raises(CatalogError, match=r"was built with other codebooks than .*codebooks.safetensors"):
            add_items(model, new, base=base)
    legacy = pq.read_table(model / "genrec/catalog.parquet")
    pq.write_table(legacy.replace_schema_metadata({}), model / "genrec/catalog.parquet")  # written before the record
    assert add_items(model, new).added == 1


def test_in_place_rewrites_a_catalog_only(built, tmp_path):
    """Found by the same probe: `--in-place --out FILE` replaced any file, the model's config.json or the input."""
    model, ids, vectors = built
    items = _items(tmp_path / "n.parquet", ["n"], vectors[:1])
    for out, args in ((model / "config.json", ("retire", model, "--items", ids[0])), (items, ("add", model, items))):
        before = out.read_bytes()
        result = _run("catalog", *args, "--out", out, "--in-place")
        assert result.exit_code != 0 and "is not a catalog (Parquet with item_id, semantic_id)" in str(result.exception)
        assert out.read_bytes() == before
