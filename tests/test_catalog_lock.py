"""`genrec catalog add | retire | import` lock the catalog file they rewrite across read-modify-write
(genrec.catalog_tools.lock): two runs at once both land, a killed holder blocks no one, new versions need no lock."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from genrec.catalog import Catalog
from genrec.catalog_tools.changes import add_items, retire_items
from genrec.catalog_tools.lock import catalog_lock, lock_path
from genrec.cli import app
from genrec.errors import GenrecError
from genrec.files import is_temporary
from genrec.model.directory import model_version

BUILT, NEW, DIM = 60, 8, 6  # the conftest model: 3 levels of 8 codes
HOLD_UNTIL_KILLED = """
import sys, time
from genrec.catalog_tools.lock import catalog_lock
with catalog_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(300)
"""


def _items(path, prefix: str, count: int, seed: int):
    vectors = np.random.default_rng(seed).normal(size=(count, DIM))
    ids = [f"{prefix}{i}" for i in range(count)]
    pq.write_table(pa.table({"item_id": ids, "embedding": vectors.tolist()}), path)
    return path, ids


@pytest.fixture
def model(tiny_dir, tmp_path):
    """A copy of the tiny model whose catalog (BUILT items) `genrec build-ids` wrote, codebooks beside it."""
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    built, _ = _items(tmp_path / "built.parquet", "x", BUILT, seed=7)
    result = CliRunner().invoke(app, ["build-ids", str(built), "--model", str(model)])
    assert result.exit_code == 0, result.output
    return model


def _genrec(*args) -> subprocess.Popen:
    command = [sys.executable, "-m", "genrec.cli", *map(str, args)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _waiting_line(run: subprocess.Popen) -> str:
    """The line `run` prints once it finds the catalog locked; failing if it ends without printing it."""
    while line := run.stderr.readline():
        if "waiting" in line:
            return line
    raise AssertionError(f"the run ended without waiting for the lock: {run.communicate()}")


def _finished(run: subprocess.Popen) -> dict:
    out, err = run.communicate(timeout=240)
    assert run.returncode == 0, err
    return json.loads(out)


def test_two_in_place_adds_at_once_keep_both_runs_items(model, tmp_path):
    """Both runs start while this test holds the lock, so both wait; released, each reads what the other wrote (one
    of them first), and the catalog holds both runs' items. Without the lock both would read the built catalog and
    the second write would drop the first run's items."""
    catalog = model / "genrec/catalog.parquet"
    built, built_bytes = Catalog.load(catalog).item_ids.tolist(), catalog.read_bytes()
    new = [_items(tmp_path / f"{prefix}.parquet", prefix, NEW, seed) for seed, prefix in enumerate("ab")]
    with catalog_lock(catalog):
        runs = [_genrec("catalog", "add", model, items, "--in-place") for items, _ in new]
        for run in runs:
            assert f"another genrec catalog run (pid {os.getpid()})" in _waiting_line(run)
        assert [run.poll() for run in runs] == [None, None]
        assert catalog.read_bytes() == built_bytes
    summaries = [_finished(run) for run in runs]
    after = Catalog.load(catalog)
    assert after.item_ids[:BUILT].tolist() == built
    assert sorted(after.item_ids[BUILT:].tolist()) == sorted(new[0][1] + new[1][1])
    assert len(np.unique(after.codes, axis=0)) == len(after)
    assert sorted(summary["items"] for summary in summaries) == [BUILT + NEW, BUILT + 2 * NEW]
    assert all(summary["catalog"] == str(catalog) for summary in summaries)
    assert not lock_path(catalog).exists()


def _genrec_source(model, tmp_path):
    source = tmp_path / "source.parquet"
    shutil.copy(model / "genrec/catalog.parquet", source)
    return source


@pytest.mark.parametrize(
    "command, changed",
    [
        (lambda model, tmp_path: ["retire", model, "--items", "x0,x1", "--in-place"], BUILT - 2),
        (lambda model, tmp_path: ["import", model, _genrec_source(model, tmp_path), "--in-place", "--force"], BUILT),
    ],
    ids=["retire", "import"],
)
def test_retire_and_import_in_place_wait_for_the_lock_too(model, tmp_path, command, changed):
    catalog = model / "genrec/catalog.parquet"
    args = command(model, tmp_path)
    with catalog_lock(catalog):
        run = _genrec("catalog", *args)
        assert str(catalog) in _waiting_line(run)
        assert run.poll() is None
    assert _finished(run)["items"] == changed == len(Catalog.load(catalog))


def test_a_lock_whose_holder_was_killed_is_no_obstacle(model, tmp_path):
    catalog = model / "genrec/catalog.parquet"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_UNTIL_KILLED, str(catalog)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(GenrecError, match=f"pid {holder.pid}"), catalog_lock(catalog, wait_s=0):
        pass
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert lock_path(catalog).exists()  # left behind by the killed run, held by no one
    items, ids = _items(tmp_path / "new.parquet", "n", NEW, seed=3)
    started = time.monotonic()
    summary = add_items(model, items, in_place=True)
    assert time.monotonic() - started < 30  # a held lock would have kept it waiting 60 s, then failed
    assert summary.added == NEW and Catalog.load(catalog).item_ids[BUILT:].tolist() == ids
    assert not lock_path(catalog).exists()


def test_a_run_kept_waiting_too_long_fails_with_one_line_naming_the_holder(tmp_path):
    catalog = tmp_path / "catalog.parquet"
    with catalog_lock(catalog):
        started = time.monotonic()
        with pytest.raises(GenrecError) as refused:
            with catalog_lock(catalog, wait_s=0.3):
                pass
        assert time.monotonic() - started >= 0.3
    message = str(refused.value)
    assert message.startswith(f"{catalog} is being changed by another genrec catalog run (pid {os.getpid()})")
    assert "\n" not in message
    with catalog_lock(catalog, wait_s=0):  # released: taken at once
        assert lock_path(catalog).read_text() == f"{os.getpid()}\n"


def test_new_versions_are_written_while_the_catalog_is_locked(model, tmp_path):
    """A change written as a new file named by its hash replaces nothing, so it takes no lock: it neither waits for
    an in-place run nor can lose one's items (the version holds the catalog it read and its own change)."""
    catalog = model / "genrec/catalog.parquet"
    built_bytes = catalog.read_bytes()
    items, ids = _items(tmp_path / "new.parquet", "n", NEW, seed=4)
    with catalog_lock(catalog):
        started = time.monotonic()
        added = add_items(model, items)
        retired = retire_items(model, ["x0"])
        assert time.monotonic() - started < 30  # a run that took the lock would have waited 60 s, then failed
    assert Catalog.load(added.catalog).item_ids[BUILT:].tolist() == ids
    assert "x0" not in Catalog.load(retired.catalog).item_ids.tolist()
    assert catalog not in (added.catalog, retired.catalog) and catalog.read_bytes() == built_bytes


def test_the_lock_file_is_part_of_no_model_version(model):
    catalog = model / "genrec/catalog.parquet"
    unlocked = model_version(model)
    with catalog_lock(catalog):
        assert is_temporary(lock_path(catalog)) and lock_path(catalog).parent == catalog.parent
        assert model_version(model) == unlocked
    assert not lock_path(catalog).exists()
