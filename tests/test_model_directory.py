"""The model directory format, the tiny-model writer, and clear errors for bad directories."""

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer
from typer.testing import CliRunner

from genrec.cli import app
from genrec.engine import Engine
from genrec.errors import CatalogError, ModelDirectoryError
from genrec.model.directory import ModelDir, model_version
from genrec.model.sid_layout import SidLayout
from genrec.model.tokenizer import LABEL_TOKENS, USER_TOKEN
from genrec.testing.tiny import ModelSpec, write_model_dir


def test_layout_is_a_plain_hf_directory_plus_genrec_subfolder(tiny_dir):
    root = sorted(p.name for p in tiny_dir.iterdir())
    assert "config.json" in root and "model.safetensors" in root and "tokenizer.json" in root
    assert [p for p in root if p.endswith(".safetensors")] == ["model.safetensors"]
    assert sorted(p.name for p in (tiny_dir / "genrec").iterdir()) == ["catalog.parquet", "soft_token.safetensors"]
    assert json.loads((tiny_dir / "config.json").read_text())["model_type"] == "qwen3"


def test_tokenizer_has_genrec_tokens(tiny_dir):
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    for label in LABEL_TOKENS:
        assert len(tok(label, add_special_tokens=False)["input_ids"]) == 1
    assert tok.convert_tokens_to_ids(USER_TOKEN) != tok.unk_token_id
    levels = SidLayout.infer(tok).level_ids
    assert [len(ids) for ids in levels] == [8, 8, 8]
    assert tok("<a_3><b_0>", add_special_tokens=False)["input_ids"] == [levels[0][3], levels[1][0]]


def test_catalog_codes_are_valid(engine):
    codes = engine.catalog.codes
    assert codes.shape == (300, 3)
    assert len(np.unique(codes, axis=0)) == 300
    assert len(set(engine.catalog.item_ids)) == 300


def test_tiny_model_is_deterministic_per_seed(tmp_path):
    spec = ModelSpec(items=40, levels=2, codebook=8)
    a = write_model_dir(tmp_path / "a", spec)
    b = write_model_dir(tmp_path / "b", spec)
    c = write_model_dir(tmp_path / "c", ModelSpec(items=40, levels=2, codebook=8, seed=5))
    for name in ("model.safetensors", "genrec/catalog.parquet", "genrec/soft_token.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_cli_tiny_model(tmp_path):
    out = tmp_path / "cli-model"
    result = CliRunner().invoke(app, ["tiny-model", str(out), "--items", "30", "--levels", "2", "--codebook", "8"])
    assert result.exit_code == 0, result.output
    engine = Engine.from_pretrained(out)
    assert len(engine.catalog) == 30 and engine.catalog.levels == 2


@pytest.fixture
def broken(tiny_dir, tmp_path):
    target = tmp_path / "broken"
    shutil.copytree(tiny_dir, target)
    return target


def write_catalog(model_dir, item_ids, codes):
    table = pa.table({"item_id": item_ids, "semantic_id": pa.array(codes, pa.list_(pa.int32()))})
    pq.write_table(table, model_dir / "genrec" / "catalog.parquet")


def expect_error(model_dir, error, *fragments):
    with pytest.raises(error) as info:
        Engine.from_pretrained(model_dir)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message


def test_missing_directory(tmp_path):
    expect_error(tmp_path / "nope", ModelDirectoryError, "does not exist")


def test_missing_config(broken):
    (broken / "config.json").unlink()
    expect_error(broken, ModelDirectoryError, "config.json")


def test_not_qwen3(broken):
    config = json.loads((broken / "config.json").read_text())
    config["model_type"] = "llama"
    (broken / "config.json").write_text(json.dumps(config))
    expect_error(broken, ModelDirectoryError, "llama", "qwen3")


def test_missing_weights(broken):
    (broken / "model.safetensors").unlink()
    expect_error(broken, ModelDirectoryError, "model.safetensors")


def test_weights_disagree_with_config(broken):
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 96
    (broken / "config.json").write_text(json.dumps(config))
    expect_error(broken, ModelDirectoryError, "mlp", "shape")


def test_missing_catalog(broken):
    (broken / "genrec" / "catalog.parquet").unlink()
    expect_error(broken, ModelDirectoryError, "catalog.parquet")


def test_missing_tokenizer(broken):
    (broken / "tokenizer.json").unlink()
    (broken / "tokenizer_config.json").unlink()
    expect_error(broken, ModelDirectoryError, "tokenizer")


def test_catalog_duplicate_item_ids(broken, engine):
    codes = engine.catalog.codes[:3].tolist()
    write_catalog(broken, ["a", "b", "a"], codes)
    expect_error(broken, CatalogError, "catalog.parquet", "duplicate item_id", "'a'")


def test_catalog_code_that_prefixes_another_needs_an_ending(broken, engine):
    codes = engine.catalog.codes[:2].tolist()
    write_catalog(broken, ["a", "b"], [codes[0], codes[0][:2]])
    expect_error(broken, CatalogError, "item 'b'", "proper prefix of item 'a'", "ending")


def test_catalog_token_outside_level_range(broken, engine):
    codes = engine.catalog.codes[:2].tolist()
    codes[1][1] = codes[1][0]  # a level-0 token at level 1
    write_catalog(broken, ["a", "b"], codes)
    expect_error(broken, CatalogError, "item 'b'", "belongs to level 0, not level 1")


def test_catalog_missing_column(broken):
    pq.write_table(pa.table({"item_id": ["a"]}), broken / "genrec" / "catalog.parquet")
    expect_error(broken, CatalogError, "semantic_id", "missing")


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["tiny-model", "OUT", "--items", "1000", "--levels", "2", "--codebook", "8"], "do not fit"),
        (["build-ids", "/no/such.parquet", "--model", "MODEL"], "no such file"),
        (["bench", "retrieve", "--preset", "huge", "--no-hf-baseline"], "unknown preset"),
        (["build-ids", "ITEMS", "--model", "HSTU"], "an HSTU ranking model, not a Qwen3 semantic-ID model"),
    ],
)
def test_cli_bad_input_is_one_clear_line(tiny_dir, hstu_dir, tmp_path, monkeypatch, capsys, argv, fragment):
    from genrec.cli import main

    named = {"OUT": tmp_path / "out", "MODEL": tiny_dir, "HSTU": hstu_dir, "ITEMS": tmp_path / "items.parquet"}
    argv = [str(named[a]) if a in named else a for a in argv]
    monkeypatch.setattr("sys.argv", ["genrec", *argv])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err and "Traceback" not in err


def test_model_version_is_a_content_hash(tiny_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    assert model_version(copy) == model_version(tiny_dir) == full_hash(tiny_dir)
    (copy / "tokenizer.json").write_bytes((copy / "tokenizer.json").read_bytes() + b" ")
    assert model_version(copy) != model_version(tiny_dir)


def test_a_catalog_change_leaves_the_model_version(tiny_dir, tmp_path):
    """The catalog is versioned apart (catalog_version): a new catalog does not change the model's K/V."""
    from genrec.catalog.catalog import catalog_version, versioned_name

    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    catalog = copy / "genrec" / "catalog.parquet"
    catalog.write_bytes(catalog.read_bytes() + b"x")
    assert model_version(copy) == model_version(tiny_dir) == full_hash(tiny_dir)
    assert catalog_version(catalog) != catalog_version(tiny_dir / "genrec" / "catalog.parquet")
    # `genrec catalog`'s versions beside it, and a write in flight, are no part of the model either
    shutil.copy(catalog, copy / "genrec" / versioned_name(catalog_version(catalog)))
    (copy / "genrec" / ".catalog.parquet.0a1b2c3d.tmp").write_bytes(b"half")
    assert model_version(copy) == model_version(tiny_dir)  # what else leaves it: tests/test_model_version.py


def full_hash(model_dir) -> str:
    """The definition: the name and sha256 of each file the loaders read (`version_files`), in name order."""
    import hashlib

    digest = hashlib.sha256()
    for file in sorted(ModelDir.open(model_dir).version_files()):
        digest.update(file.relative_to(model_dir).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()[:16]


@pytest.fixture
def recorded_dir(tiny_dir, tmp_path, monkeypatch):
    """A copy of the tiny model whose weights count as large (recorded) and were written a while ago; reads of
    every large file are counted."""
    from genrec.model import directory as digests

    copy = tmp_path / "recorded"
    shutil.copytree(tiny_dir, copy)
    age(copy / "model.safetensors")
    monkeypatch.setattr(digests, "LARGE_BYTES", (copy / "model.safetensors").stat().st_size)  # the largest file
    reads = []
    original = digests.file_sha256
    monkeypatch.setattr(digests, "file_sha256", lambda path: reads.append(path.name) or original(path))
    return copy, reads


def age(path, seconds=60):
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns - seconds * 10**9))


def test_model_version_reads_the_weights_once_then_uses_the_record(recorded_dir):
    model_dir, reads = recorded_dir
    assert model_version(model_dir) == full_hash(model_dir)
    record = json.loads((model_dir / "genrec" / "digests.json").read_text())
    assert list(record) == ["model.safetensors"] and reads.count("model.safetensors") == 1
    assert model_version(model_dir) == full_hash(model_dir)  # the record is not part of the version
    assert reads.count("model.safetensors") == 1 and "tokenizer.json" in reads  # small files: every time


def test_model_version_sees_a_same_size_edit_of_the_weights(recorded_dir):
    model_dir, reads = recorded_dir
    before = model_version(model_dir)
    weights = model_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # a value in the last tensor: same size, same header
    weights.write_bytes(bytes(data))
    assert model_version(model_dir) == full_hash(model_dir) != before
    assert reads.count("model.safetensors") == 2


def test_model_version_rehashes_a_touched_file_and_ignores_a_bad_record(recorded_dir):
    model_dir, reads = recorded_dir
    version = model_version(model_dir)
    age(model_dir / "model.safetensors", seconds=30)  # same bytes, another modification time
    assert model_version(model_dir) == version and reads.count("model.safetensors") == 2
    assert model_version(model_dir) == version and reads.count("model.safetensors") == 2  # recorded again
    (model_dir / "genrec" / "digests.json").write_text('{"model.safetensors": {"size": 1, "sha256": 7}')
    assert model_version(model_dir) == version and reads.count("model.safetensors") == 3


def test_cli_model_version_prints_it_and_records_the_weights(recorded_dir):
    model_dir, reads = recorded_dir
    result = CliRunner().invoke(app, ["model-version", str(model_dir)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == full_hash(model_dir)
    assert (model_dir / "genrec" / "digests.json").exists()


def test_a_file_written_just_now_is_not_recorded(recorded_dir):
    model_dir, reads = recorded_dir
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # a coarse clock could give an edit in the next tick this mtime
    model_version(model_dir)
    assert not (model_dir / "genrec" / "digests.json").exists()


def edit_config(model_dir, **fields):
    config = json.loads((model_dir / "config.json").read_text())
    config.update(fields)
    (model_dir / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "body, fragment",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (None, "hidden_size must be a positive integer, not 'abc'"),
    ],
)
def test_invalid_config_is_reported_as_config_not_tokenizer(broken, body, fragment):
    if body is None:
        edit_config(broken, hidden_size="abc")
    else:
        (broken / "config.json").write_text(body)
    expect_error(broken, ModelDirectoryError, "config.json", fragment)
    with pytest.raises(ModelDirectoryError) as info:
        Engine.from_pretrained(broken)
    assert "tokenizer" not in str(info.value)


@pytest.mark.parametrize("field, value", [("num_hidden_layers", 0), ("vocab_size", -5), ("head_dim", 15)])
def test_config_fields_out_of_range(broken, field, value):
    edit_config(broken, **{field: value})
    expect_error(broken, ModelDirectoryError, "config.json", field)


def test_max_positions_must_hold_a_prompt_token_and_a_code(broken):
    edit_config(broken, max_position_embeddings=3)  # the tiny model's codes have 3 levels
    expect_error(broken, ModelDirectoryError, "config.json", "max_position_embeddings 3", "needs at least 4")
    edit_config(broken, max_position_embeddings=4)
    assert Engine.from_pretrained(broken).family.max_prompt_tokens == 1


def test_catalog_path_that_is_a_directory(broken):
    (broken / "genrec" / "catalog.parquet").unlink()
    (broken / "genrec" / "catalog.parquet").mkdir()
    expect_error(broken, CatalogError, "catalog.parquet", "is a directory")


def rewrite_weight(model_dir, name, change):
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors[name] = change(tensors[name])
    save_file(tensors, str(model_dir / "model.safetensors"))


def shard_index(model_dir, shard_name):
    (model_dir / "model.safetensors").unlink()
    names = ["model.embed_tokens.weight"]  # the rest is unread: the first shard is refused
    index = {"weight_map": dict.fromkeys(names, shard_name)}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_weight_map_paths_must_stay_inside_the_directory(broken, tmp_path, where):
    outside = tmp_path / "outside.safetensors"
    shutil.copy(broken / "model.safetensors", outside)  # a valid file: only its place is wrong
    shard_index(broken, str(outside) if where == "absolute" else "../outside.safetensors")
    expect_error(broken, ModelDirectoryError, "model.safetensors.index.json", "outside.safetensors", "inside")


def test_symlinked_shards_load_as_in_the_hugging_face_cache(broken, tmp_path):
    blob = tmp_path / "blobs" / "0123abcd"  # the HF cache links snapshot files to blobs outside the snapshot
    blob.parent.mkdir()
    shutil.move(broken / "model.safetensors", blob)
    (broken / "model-00001-of-00001.safetensors").symlink_to(blob)
    names = load_file(str(blob)).keys()
    index = {"weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    assert len(Engine.from_pretrained(broken).catalog) == 300


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(broken, value):
    rewrite_weight(broken, "model.layers.1.mlp.up_proj.weight", lambda w: w.index_fill(0, torch.tensor([3]), value))
    expect_error(broken, ModelDirectoryError, "model.layers.1.mlp.up_proj.weight", "NaN or infinite")


def test_weights_that_overflow_the_model_dtype_are_refused(broken):
    rewrite_weight(broken, "model.norm.weight", lambda w: w.fill_(1e6))  # finite in float32, not in float16
    with pytest.raises(ModelDirectoryError, match="model.norm.weight holds NaN or infinite values"):
        Engine.from_pretrained(broken, dtype=torch.float16)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_integer_or_bool_weights_are_refused_naming_the_tensor(broken, dtype):
    name = "model.layers.0.self_attn.q_proj.weight"
    rewrite_weight(broken, name, lambda w: w.to(dtype))
    expect_error(broken, ModelDirectoryError, name, str(dtype), "floating point")
