"""Tiny OpenOneRec- and MiniOneRec-layout checkpoints for the tests of issue #30 (layouts, importers, engine
equality, Serve and batch); conftest.py's `openonerec` and `minionerec` fixtures write them once per session."""

import shutil

from genrec.model.open_layouts import OpenLayoutSpec

OPEN_SPEC = OpenLayoutSpec(items=120, codebook=16, shared=12, seed=3)


def fresh_copy(checkpoint, tmp_path):
    """A copy of a written checkpoint's directory a test may change (its item map inside it)."""
    target = tmp_path / checkpoint.model_dir.name
    shutil.copytree(checkpoint.model_dir, target)
    return target, target / checkpoint.item_map.name
