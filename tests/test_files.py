"""Every file genrec writes has the modes the umask gives and is written atomically (genrec.files)."""

import os
import stat

import numpy as np
import pytest
import torch

from genrec.catalog import Catalog
from genrec.catalog_tools.codebooks import Codebooks
from genrec.files import write_atomically
from genrec.model.soft_token import SoftTokenProjector


@pytest.fixture
def umask_027():
    previous = os.umask(0o027)
    yield
    os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _catalog(n=4) -> Catalog:
    return Catalog(np.array([f"i{k}" for k in range(n)], dtype=object), np.arange(3 * n).reshape(n, 3))


def test_files_and_folders_get_the_modes_the_umask_gives(tmp_path, umask_027):
    """0666 / 0777 less the umask, not 0600 (a temporary file's, or safetensors' own), so replicas and batch actors
    running as another user of the group can read a new catalog version."""
    folder = tmp_path / "made" / "here"
    written = {
        "catalog": folder / "catalog.parquet",
        "codebooks": folder / "codebooks.safetensors",
        "soft_token": folder / "soft_token.safetensors",
    }
    _catalog().save(written["catalog"])
    Codebooks(1.0, (torch.zeros(4, 3), torch.ones(2, 3)), 5).save(written["codebooks"])
    SoftTokenProjector(3, 8).save(written["soft_token"])
    assert {name: oct(_mode(path)) for name, path in written.items()} == dict.fromkeys(written, oct(0o640))
    assert _mode(folder) == _mode(folder.parent) == 0o750
    assert Catalog.load(written["catalog"]).item_ids.tolist() == ["i0", "i1", "i2", "i3"]
    assert Codebooks.load(written["codebooks"])[0].last_size == 5


def test_a_catalog_version_written_by_the_cli_has_the_umask_modes(tiny_dir, tmp_path, umask_027):
    from genrec.catalog_tools.changes import retire_items

    out = tmp_path / "versions" / "v2.parquet"
    change = retire_items(tiny_dir, ["item-000003"], out)
    assert change.catalog == out and _mode(out) == 0o640 and _mode(out.parent) == 0o750


def test_save_replaces_the_file_never_rewrites_it(tmp_path):
    """A reader holding the old file keeps reading the old bytes: the new one is another inode renamed over it."""
    path = tmp_path / "catalog.parquet"
    _catalog(4).save(path)
    old = path.read_bytes()
    with path.open("rb") as reader:
        inode = os.fstat(reader.fileno()).st_ino
        _catalog(6).save(path)
        assert os.stat(path).st_ino != inode
        assert reader.read() == old
    assert len(Catalog.load(path)) == 6


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "catalog.parquet"
    _catalog().save(path)
    before = path.read_bytes()
    with pytest.raises(TypeError):
        write_atomically(path, "not bytes")  # fails after the temporary file was made
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["catalog.parquet"]
