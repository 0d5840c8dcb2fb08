"""Two runs started at once into one output directory: both look for OUT/manifest.json and find none. Only one may
write it; the other sees it and is refused if its settings differ (issue #46, item 6: before, both went on with
their own run_ids and their shards mixed in one directory)."""

import json
import threading

import pyarrow.fs as pafs
import pytest

from genrec.batch.output import OutputDir
from genrec.errors import GenrecError


def _open_at_once(tmp_path, monkeypatch, identities):
    """open_run for each identity in its own thread, all past the manifest lookup before any writes it."""
    barrier = threading.Barrier(len(identities))
    create = OutputDir._create

    def create_together(self, path, data):
        barrier.wait(timeout=30)  # every run has looked and found no manifest
        return create(self, path, data)

    monkeypatch.setattr(OutputDir, "_create", create_together)
    out = str(tmp_path / "out")
    dirs = [OutputDir(out, "recommendations") for _ in identities]
    results: list = [None] * len(identities)

    def run(i):
        try:
            results[i] = dirs[i].open_run(identities[i])
        except GenrecError as err:
            results[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(identities))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, dirs, results


def test_two_runs_with_other_settings_at_once_one_is_refused(tmp_path, monkeypatch):
    out, dirs, results = _open_at_once(
        tmp_path, monkeypatch, [{"model_version": "m", "beam_width": 8}, {"model_version": "m", "beam_width": 16}]
    )
    refused = [r for r in results if isinstance(r, GenrecError)]
    accepted = [(d, r) for d, r in zip(dirs, results, strict=True) if isinstance(r, str)]
    assert len(refused) == 1 and len(accepted) == 1, results
    assert "holds the output of another run (beam_width" in str(refused[0])
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["run_id"] == accepted[0][1]
    # The refused run wrote no manifest: abandoning it leaves the winner's in place.
    loser = dirs[results.index(refused[0])]
    assert not loser.new_run
    loser.abandon_new_run()
    assert (tmp_path / "out" / "manifest.json").exists()
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]  # no temporary left


def test_two_runs_with_the_same_settings_at_once_share_the_run(tmp_path, monkeypatch):
    identity = {"model_version": "m", "beam_width": 8}
    _, dirs, results = _open_at_once(tmp_path, monkeypatch, [identity, dict(identity)])
    assert results[0] == results[1] and isinstance(results[0], str)
    assert sorted(d.new_run for d in dirs) == [False, True]  # one of them wrote it


def test_without_hard_links_the_manifest_is_moved_and_read_back(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise PermissionError("hard links not supported")

    monkeypatch.setattr("genrec.batch.output.os.link", no_links)
    out = OutputDir(str(tmp_path / "out"), "recommendations")
    run_id = out.open_run({"model_version": "m"})
    assert out.new_run and json.loads((tmp_path / "out" / "manifest.json").read_text())["run_id"] == run_id
    with pytest.raises(GenrecError, match="another run"):
        OutputDir(str(tmp_path / "out"), "recommendations").open_run({"model_version": "other"})


def test_an_object_store_manifest_overwritten_meanwhile_is_seen(tmp_path):
    """A filesystem other than the local one (here a SubTreeFileSystem, as an object store would be) is written,
    then read back: a run whose manifest another run replaced is refused."""
    fs = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    out = OutputDir(str(tmp_path / "out"), "recommendations")
    out.fs, out.root = fs, "out"
    out.manifest = "out/manifest.json"
    fs.create_dir("out")
    original = out._write

    def overwritten(path, write):
        original(path, write)
        with fs.open_output_stream(path) as stream:  # another run's manifest lands just after ours
            stream.write(json.dumps({"model_version": "other", "run_id": "x"}).encode())

    out._write = overwritten
    assert out._create("out/manifest.json", b'{"model_version": "m"}') == {"model_version": "other", "run_id": "x"}


def test_a_second_run_leaves_the_first_runs_temporaries_being_written(tmp_path, monkeypatch):
    """Run B starts (same settings) while run A writes a shard: B's clean-up of killed writers' temporaries must not
    delete A's file before A moves it into place (it did: A's commit failed, FileNotFoundError). Temporaries older
    than STALE_TMP_AGE_S still go."""
    import os
    import time

    import pyarrow as pa

    from genrec.batch import output
    from genrec.batch.shards import Shard

    identity = {"model_version": "m", "beam_width": 8}
    first, second = (OutputDir(str(tmp_path / "out"), "recommendations") for _ in range(2))
    first.open_run(identity)
    stale = tmp_path / "out" / "errors" / ".part-000007.parquet.0123.tmp"  # a writer killed long ago
    stale.write_bytes(b"partial")
    old = time.time() - output.STALE_TMP_AGE_S - 60
    os.utime(stale, (old, old))
    write_table, removed = output.pq.write_table, []

    def meanwhile(table, where, **kwargs):  # A is writing its temporary when B starts
        write_table(table, where, **kwargs)
        assert second.open_run(identity) == first.open_run(identity)
        removed.append(second.remove_stale_tmp())

    monkeypatch.setattr(output.pq, "write_table", meanwhile)
    shard = Shard(index=0, path=str(tmp_path / "users.parquet"), start=0, stop=1)
    table = pa.table({"user_id": pa.array([1], pa.int64())})
    assert first.commit(shard, table, table).rows == 1  # A's files landed
    assert removed == [1, 0] and not stale.exists()  # the old one went, with B's first clean-up
    assert sorted(p.name for p in (tmp_path / "out" / "recommendations").iterdir()) == [shard.name]
    assert sorted(p.name for p in (tmp_path / "out" / "errors").iterdir()) == [shard.name]
