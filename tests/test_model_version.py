"""The model version covers exactly what the family's loaders read (`ModelDir.version_files`): a file a loader opens
that the version misses fails here; catalogs, notes and caches beside the model leave the version as it is."""

from __future__ import annotations

import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from genrec.model.directory import RECORD, ModelDir, model_version
from genrec.model.sid_layout import SidLayout
from genrec.model.tokenizer import load_tokenizer

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


# -- recording the files opened ------------------------------------------------------------------------------------

_recording: list[str] | None = None  # the paths opened while `opened_files` runs; None: not recording


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _recording is not None and isinstance(args[0], str | bytes | os.PathLike):
        _recording.append(os.fsdecode(args[0]))


_hooked = False


@contextmanager
def opened_files(root: Path):
    """Every file under `root` opened inside the block (the 'open' audit event: builtins.open, io.open, os.open,
    from any library); paths relative to `root`. An audit hook cannot be removed: it is installed once, and idle
    outside the block."""
    global _hooked, _recording
    if not _hooked:
        sys.addaudithook(_audit)
        _hooked = True
    found: set[str] = set()
    _recording = []
    try:
        yield found
    finally:
        opened, _recording = _recording, None
        resolved = root.resolve()
        for path in opened:
            path = Path(path).resolve()
            if path.is_relative_to(resolved):
                found.add(path.relative_to(resolved).as_posix())


# -- model directories with every file a loader may read -----------------------------------------------------------


@pytest.fixture(scope="module")
def full_qwen3(tiny_dir, tmp_path_factory):
    """The tiny decoder with all its optional files: a chat template, genrec/prompt.json, genrec/sid_layout.json,
    and its weights sharded behind an index."""
    model_dir = tmp_path_factory.mktemp("version") / "qwen3"
    shutil.copytree(tiny_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    genrec = model_dir / "genrec"
    (genrec / "prompt.json").write_text(json.dumps({"version": 1, "system_prompt": "You recommend items."}))
    tokenizer = load_tokenizer(model_dir)
    (genrec / "sid_layout.json").write_text(json.dumps(SidLayout.infer(tokenizer).to_json(tokenizer)))
    shard(model_dir)
    return model_dir


def shard(model_dir: Path) -> None:
    """model.safetensors split into two shards named by model.safetensors.index.json."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    names = sorted(tensors)
    halves = {SHARDS[0]: names[: len(names) // 2], SHARDS[1]: names[len(names) // 2 :]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(model_dir / file))
    index = {"metadata": {}, "weight_map": {k: file for file, keys in halves.items() for k in keys}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    (model_dir / "model.safetensors").unlink()


@pytest.fixture(params=["qwen3", "hstu"])
def model_copy(request, full_qwen3, hstu_dir, tmp_path):
    """A fresh copy of each family's model directory (its catalog with it)."""
    source = full_qwen3 if request.param == "qwen3" else hstu_dir
    shutil.copytree(source, tmp_path / "model")
    return tmp_path / "model"


def version_names(model_dir: Path) -> set[str]:
    return {file.relative_to(model_dir).as_posix() for file in ModelDir.open(model_dir).version_files()}


# -- the tests ------------------------------------------------------------------------------------------------------


def test_the_version_covers_each_file_the_family_reads(full_qwen3, hstu_dir):
    assert version_names(full_qwen3) == {
        "config.json", "model.safetensors.index.json", *SHARDS, "tokenizer.json", "tokenizer_config.json",
        "chat_template.jinja", "genrec/prompt.json", "genrec/sid_layout.json", "genrec/soft_token.safetensors",
    }  # fmt: skip
    assert version_names(hstu_dir) == {"config.json", "model.safetensors", "genrec/catalog.parquet"}


def test_loading_an_engine_opens_no_file_the_version_misses(model_copy):
    from genrec.engine import Engine

    directory = ModelDir.open(model_copy)
    with opened_files(model_copy) as opened:
        Engine.from_pretrained(model_copy)
    # The digest record is the version's own cache; a decoder's catalog is versioned apart (catalog_version).
    apart = {f"genrec/{RECORD}"} | ({"genrec/catalog.parquet"} if directory.family == "qwen3" else set())
    assert opened - apart <= version_names(model_copy)
    # the recording sees what was read: the config, the weights and (HSTU) the item index at least
    assert {"config.json", "genrec/catalog.parquet"} <= opened
    assert opened & {"model.safetensors", *SHARDS}


def test_loading_a_decoder_opens_its_optional_files(full_qwen3):
    """The recorder sees each optional file a decoder reads, so the test above checks them too."""
    from genrec.engine import Engine

    with opened_files(full_qwen3) as opened:
        Engine.from_pretrained(full_qwen3)
    optional = {"chat_template.jinja", "genrec/prompt.json", "genrec/sid_layout.json", "genrec/soft_token.safetensors"}
    assert optional | {"model.safetensors.index.json", *SHARDS, "tokenizer.json"} <= opened


STRAY_FILES = (
    "genrec/catalogs/2026-12-02.parquet",  # `genrec catalog add --out` anywhere
    "genrec/catalog-0123456789ab.parquet",
    "genrec/catalog-notahash.parquet",
    "genrec/codebooks.safetensors",
    "genrec/notes.txt",
    "catalog.parquet",
    "pid2sid.parquet",  # an open checkpoint's item map, beside its files
    "README.md",
    "generation_config.json",  # no loader reads it
    ".cache/huggingface/download/model.safetensors.lock",
    "genrec/.catalog.parquet.0a1b2c3d.tmp",  # a write in flight
)


def test_catalogs_and_stray_files_leave_the_version(model_copy):
    before = model_version(model_copy)
    for name in STRAY_FILES:
        (model_copy / name).parent.mkdir(parents=True, exist_ok=True)
        (model_copy / name).write_bytes(b"not part of the model")
    assert model_version(model_copy) == before


def test_a_new_decoder_catalog_leaves_its_version(full_qwen3, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(full_qwen3, model_dir)
    before = model_version(model_dir)
    catalog = model_dir / "genrec" / "catalog.parquet"
    catalog.write_bytes(catalog.read_bytes() + b"x")
    assert model_version(model_dir) == before


def test_an_hstu_item_index_is_part_of_its_version(hstu_dir, tmp_path):
    """Its embedding rows were trained against the index: another index is another model."""
    model_dir = tmp_path / "model"
    shutil.copytree(hstu_dir, model_dir)
    before = model_version(model_dir)
    catalog = model_dir / "genrec" / "catalog.parquet"
    catalog.write_bytes(catalog.read_bytes() + b"x")
    assert model_version(model_dir) != before


@pytest.mark.parametrize(
    "name",
    [SHARDS[1], "model.safetensors.index.json", "config.json", "tokenizer.json", "tokenizer_config.json",
     "chat_template.jinja", "genrec/prompt.json", "genrec/sid_layout.json", "genrec/soft_token.safetensors"],
)  # fmt: skip
def test_a_changed_file_the_decoder_reads_changes_its_version(full_qwen3, tmp_path, name):
    model_dir = tmp_path / "model"
    shutil.copytree(full_qwen3, model_dir)
    before = model_version(model_dir)
    change(model_dir / name)
    assert model_version(model_dir) != before


def test_a_changed_weight_byte_changes_an_hstu_version(hstu_dir, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(hstu_dir, model_dir)
    before = model_version(model_dir)
    change(model_dir / "model.safetensors")
    assert model_version(model_dir) != before


def change(path: Path) -> None:
    """A text file gets a newline more (it still parses); a binary one keeps its size, one bit of its last byte
    flipped (a weight's value, past the safetensors header)."""
    data = path.read_bytes()
    if path.suffix in (".json", ".jinja"):
        path.write_bytes(data + b"\n")
    else:
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
