"""`genrec deploy` / `python -m genrec.serving.check` read each catalog file a config's retriever replicas will load
(the one its `user_config` names, and the model directory's own) as a replica would, with or without `--model`:
without it, the file alone and without torch; with it, its codes against the model too. A file a replica would
refuse is refused before anything is sent; a missing one too unless the deploy says it arrives later; a model
directory not readable here is a warning that the check was partial."""

import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from genrec.catalog import Catalog
from genrec.catalog.catalog import catalog_version, versioned_name
from genrec.serving.check import BUILDER, findings, main, problems

FIELD = "applications[0].deployments[0].user_config.catalog"
OWN_FIELD = "applications[0].args.retriever.model_dir"


def config_naming(model_dir, catalog=None) -> dict:
    """A Serve config whose retriever serves `model_dir` and whose user_config names `catalog` (if any)."""
    user_config = {"max_queue": 4} | ({"catalog": str(catalog)} if catalog is not None else {})
    app = {"name": "genrec", "route_prefix": "/", "import_path": BUILDER}
    app["args"] = {"retriever": {"model_dir": str(model_dir)}}
    app["deployments"] = [{"name": "EngineServer", "user_config": user_config}]
    return {"applications": [app]}


def tiny_catalog(tiny_dir) -> Catalog:
    return Catalog.load(tiny_dir / "genrec/catalog.parquet")


def versioned(catalog: Catalog, folder):
    """`catalog` written as `genrec catalog` writes a version: named by its content hash."""
    folder.mkdir(parents=True, exist_ok=True)
    draft = folder / "draft.parquet"
    catalog.save(draft)
    return draft.rename(folder / versioned_name(catalog_version(draft)))


def truncated(path, out):
    data = path.read_bytes()
    out.write_bytes(data[: len(data) // 2])
    return out


def wrong_hash(path, out_folder):
    """The file under a versioned name that is not its content hash (as if rewritten after it was named)."""
    out_folder.mkdir(parents=True, exist_ok=True)
    name = versioned_name("0" * 16) if catalog_version(path)[:12] != "0" * 12 else versioned_name("1" * 16)
    return shutil.copy(path, out_folder / name)


def without_item_id(tiny_dir, out):
    table = pq.read_table(tiny_dir / "genrec/catalog.parquet")
    pq.write_table(table.rename_columns(["id" if c == "item_id" else c for c in table.column_names]), out)
    return out


def codes_of_another_model(tiny_dir) -> Catalog:
    """A catalog whose codes are token IDs the tiny model's SID layout does not have (valid as a file)."""
    catalog = tiny_catalog(tiny_dir)
    return Catalog.validated(
        catalog.item_ids.tolist(), [np.array(catalog.code(i)) + 10_000 for i in range(len(catalog))]
    )


def bad_files(tiny_dir, good, tmp_path) -> dict:
    """Each kind of file a replica refuses, and what its refusal says."""
    table = pq.read_table(good)
    duplicate_ids = table.set_column(0, "item_id", pa.array(["same"] * table.num_rows))
    empty_code = table.set_column(1, "semantic_id", pa.array([[]] * table.num_rows, pa.list_(pa.int32())))
    null_popularity = table.append_column("popularity", pa.array([None] * table.num_rows, pa.float64()))
    written = {}
    for name, bad in {
        "dup.parquet": duplicate_ids,
        "empty.parquet": empty_code,
        "pop.parquet": null_popularity,
    }.items():
        pq.write_table(bad, tmp_path / name)
        written[name] = tmp_path / name
    return {
        "truncated": (truncated(good, tmp_path / "cut.parquet"), "not a readable Parquet file"),
        "wrong hash": (wrong_hash(good, tmp_path / "renamed"), "its content hash is"),
        "no item_id": (without_item_id(tiny_dir, tmp_path / "ids.parquet"), "column 'item_id' is missing"),
        "a directory": (tmp_path / "renamed", "is a directory"),
        "duplicate items": (written["dup.parquet"], "duplicate item_ids: ['same']"),
        "an empty code": (written["empty.parquet"], "column 'semantic_id' is empty on"),
        "null popularity": (written["pop.parquet"], "column 'popularity', item"),
    }


KINDS = ["truncated", "wrong hash", "no item_id", "a directory", "duplicate items", "an empty code", "null popularity"]


@pytest.fixture
def good(tiny_dir, tmp_path):
    return versioned(tiny_catalog(tiny_dir), tmp_path / "catalogs")


def test_a_good_catalog_passes_with_and_without_the_model(tiny_dir, good):
    config = config_naming(tiny_dir, good)
    assert problems(config) == [] and problems(config, check_model=True) == []
    assert findings(config).warnings == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_file_a_replica_would_refuse_is_refused_naming_the_field(tiny_dir, good, tmp_path, kind):
    path, expected = bad_files(tiny_dir, good, tmp_path)[kind]
    for check_model in (False, True):
        (problem,) = problems(config_naming(tiny_dir, path), check_model=check_model)
        assert problem.startswith(f"{FIELD}: ") and str(path) in problem and expected in problem, problem


def test_codes_the_model_cannot_emit_are_refused_with_the_model(tiny_dir, tmp_path):
    path = versioned(codes_of_another_model(tiny_dir), tmp_path)
    config = config_naming(tiny_dir, path)
    assert problems(config) == []  # the file alone is a valid catalog
    (problem,) = problems(config, check_model=True)
    assert problem.startswith(f"{FIELD}: ") and "is not a semantic-ID token of this model" in problem, problem


def test_a_missing_catalog_is_refused_unless_the_deploy_says_it_arrives(tiny_dir, tmp_path):
    config = config_naming(tiny_dir, "catalogs/next.parquet")  # relative to the model directory
    for check_model in (False, True):
        (problem,) = problems(config, check_model=check_model)
        assert problem.startswith(f"{FIELD}: {tiny_dir / 'catalogs/next.parquet'}: catalog file is missing here")
        assert "--catalog-arrives" in problem
        assert problems(config, check_model=check_model, catalog_arrives=True) == []


def test_the_model_directorys_own_catalog_is_checked_too(tiny_dir, tmp_path):
    """Every retriever replica loads genrec/catalog.parquet at start, whatever its user_config names."""
    model = shutil.copytree(tiny_dir, tmp_path / "model")
    assert problems(config_naming(model)) == []
    truncated(tiny_dir / "genrec/catalog.parquet", model / "genrec/catalog.parquet")
    (problem,) = problems(config_naming(model))
    assert problem.startswith(f"{OWN_FIELD}: {model / 'genrec/catalog.parquet'}: not a readable Parquet file")
    (model / "genrec/catalog.parquet").unlink()
    (problem,) = problems(config_naming(model), catalog_arrives=True)  # the flag is for the declared catalog
    assert problem.startswith(f"{OWN_FIELD}: ") and "catalog file is missing" in problem


def test_a_model_directory_not_readable_here_is_a_partial_check_with_a_warning(tiny_dir, good, tmp_path, capsys):
    elsewhere = tmp_path / "on-the-gpu-nodes-only"
    config = config_naming(elsewhere, "catalogs/next.parquet")
    found = findings(config)
    assert found.problems == []
    (warning,) = found.warnings
    assert warning.startswith(f"{OWN_FIELD}: {elsewhere} is not readable here") and "partial check" in warning
    assert str(elsewhere / "genrec/catalog.parquet") in warning and str(elsewhere / "catalogs/next.parquet") in warning
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main([str(path)]) == 0
    out = capsys.readouterr()
    assert out.err == f"warning: {path}: {warning}\n" and out.out == f"ok: {path}\n"
    bad = truncated(good, tmp_path / "cut.parquet")  # a file that is here is checked all the same
    (problem,) = problems(config_naming(elsewhere, bad))
    assert problem.startswith(f"{FIELD}: {bad}: not a readable Parquet file")


def test_the_check_without_the_model_does_not_import_torch(tiny_dir, good, tmp_path):
    bad = truncated(good, tmp_path / "cut.parquet")
    script = (
        "import sys, yaml\n"
        "from genrec.serving.check import problems\n"
        f"good, bad = problems({config_naming(tiny_dir, good)!r}), problems({config_naming(tiny_dir, bad)!r})\n"
        "assert good == [] and len(bad) == 1 and 'not a readable Parquet file' in bad[0], (good, bad)\n"
        "print('torch' in sys.modules, 'genrec.catalog.trie' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]
