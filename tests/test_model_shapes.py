"""A model directory whose config.json disagrees with its tensors (num_items raised for a grown catalog, another
hidden_size, an integer tensor, a tensor missing, an HSTU tensor the config does not imply) is refused from the
weight files' headers alone (ModelDir.check), with the same rule loading applies: by the deploy's preflight (the
builder, `genrec.serving.check --model`) and by the batch driver (one `error:` line, exit 2, before any Ray work).
The redeploy of such a ranker under load is in tests/test_serving_funnel.py."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from genrec.errors import ModelDirectoryError
from genrec.model.directory import ModelDir
from genrec.model.hstu import load_hstu
from genrec.model.qwen3 import load_qwen3
from genrec.serving import check
from genrec.serving.app import build_app
from genrec.serving.args import AppArgs
from genrec.serving.preflight import DeployRefused
from genrec.testing.tiny import ModelSpec, write_model_dir
from tests import rank_inputs

REPO = Path(__file__).resolve().parents[1]


def edit_config(model_dir: Path, **changes) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {k: config[k] + v for k, v in changes.items()}))


def edit_tensors(model_dir: Path, change) -> None:
    tensors = load_file(str(model_dir / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(model_dir / "model.safetensors"))


def to_int(name: str):
    return lambda tensors: tensors.__setitem__(name, tensors[name].to(torch.int32))


def drop(name: str):
    return lambda tensors: tensors.pop(name)


def cut(name: str):
    return lambda tensors: tensors.__setitem__(name, tensors[name][:-1])


def add(name: str):
    return lambda tensors: tensors.__setitem__(name, torch.zeros(3, 2))


# (case, how the directory is broken, what the error says); `num_items` etc: a config change, else the tensors'.
HSTU_CASES = [
    ("num_items raised", {"num_items": 40}, ["item_embedding.weight", "shape [60, 16]", "implies shape [100, 16]"]),
    ("hidden_size changed", {"hidden_size": 8}, ["item_embedding.weight", "[60, 16]", "implies shape [60, 24]"]),
    ("an integer tensor", to_int("head.out.weight"), ["head.out.weight", "torch.int32", "floating point"]),
    ("a tensor missing", drop("final_norm.bias"), ["lack 1 tensors", "final_norm.bias", "model.safetensors"]),
    ("an extra tensor", add("layers.9.out.weight"), ["1 tensors config.json does not imply", "layers.9.out.weight"]),
    ("time buckets turned off", {"num_time_buckets": -4}, ["does not imply", "bucket_embedding.weight"]),
]
QWEN3_CASES = [
    ("vocab_size raised", {"vocab_size": 16}, ["model.embed_tokens.weight", "implies shape"]),
    ("hidden_size changed", {"hidden_size": 32}, ["model.embed_tokens.weight", "64]", "96]"]),
    ("an integer tensor", to_int("model.layers.1.mlp.down_proj.weight"), ["down_proj.weight", "torch.int32"]),
    ("a tensor missing", drop("model.layers.0.self_attn.k_norm.weight"), ["lack 1 tensors", "k_norm.weight"]),
]
# Qwen2 (q/k/v biases, no q/k norm): kv_heads 2 x head_dim 16 = 32 outputs of k_proj.
QWEN2_CASES = [
    ("a bias missing", drop("model.layers.1.self_attn.v_proj.bias"), ["lack 1 tensors", "v_proj.bias"]),
    ("a bias cut short", cut("model.layers.0.self_attn.k_proj.bias"), ["k_proj.bias", "[31]", "implies shape [32]"]),
]


@pytest.fixture(scope="module")
def hstu_dir(tmp_path_factory):
    return rank_inputs.model_dir(tmp_path_factory.mktemp("shapes"))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("shapes") / "qwen3", ModelSpec(items=40, levels=2, codebook=8))


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    spec = ModelSpec(items=40, levels=2, codebook=8, architecture="qwen2")
    return write_model_dir(tmp_path_factory.mktemp("shapes") / "qwen2", spec)


def broken_copy(source: Path, tmp_path: Path, how) -> Path:
    copy = shutil.copytree(source, tmp_path / "broken")
    if isinstance(how, dict):
        edit_config(copy, **how)
    else:
        edit_tensors(copy, how)
    return copy


def refused_alike(model_dir: Path, fragments: list[str]) -> str:
    """The header check refuses the directory saying `fragments`, naming the file; the tensors, once read, are
    refused for the same reason (the one rule: `Layout.match`), with the file names left out (they are in memory)."""
    directory = ModelDir.open(model_dir)
    with pytest.raises(ModelDirectoryError) as checked:
        directory.check()
    message = str(checked.value)
    for fragment in fragments:
        assert fragment in message, message
    assert message.startswith(str(model_dir)) and "\n" not in message
    load = load_hstu if directory.family == "hstu" else load_qwen3
    with pytest.raises(ModelDirectoryError) as loaded:
        load(directory.config, directory.load_weights(), model_dir)
    for fragment in fragments:
        assert fragment in str(loaded.value) or fragment.endswith(".safetensors"), loaded.value
    return message


def test_good_directories_pass_and_their_layout_is_the_loaded_models(hstu_dir, qwen3_dir):
    for model_dir in (hstu_dir, qwen3_dir):
        directory = ModelDir.open(model_dir)
        directory.check()
        model = directory.load_model()
        assert directory.layout().shapes == {name: tuple(p.shape) for name, p in model.named_parameters()}


@pytest.mark.parametrize(("case", "how", "fragments"), HSTU_CASES, ids=[c[0] for c in HSTU_CASES])
def test_an_hstu_directory_that_disagrees_with_its_config_is_refused(hstu_dir, tmp_path, case, how, fragments):
    model_dir = broken_copy(hstu_dir, tmp_path, how)
    refused_alike(model_dir, fragments)
    with pytest.raises(DeployRefused, match="ranker.model_dir: ") as err:  # the builder's preflight
        build_app(AppArgs(ranker={"model_dir": str(model_dir)}))
    assert fragments[0] in str(err.value)


@pytest.mark.parametrize(("case", "how", "fragments"), QWEN3_CASES, ids=[c[0] for c in QWEN3_CASES])
def test_a_qwen3_directory_that_disagrees_with_its_config_is_refused(qwen3_dir, tmp_path, case, how, fragments):
    model_dir = broken_copy(qwen3_dir, tmp_path, how)
    refused_alike(model_dir, fragments)
    with pytest.raises(DeployRefused, match="retriever.model_dir: ") as err:
        build_app(AppArgs(retriever={"model_dir": str(model_dir)}))
    assert fragments[0] in str(err.value)


def test_a_qwen2_layout_expects_qkv_biases_and_no_qk_norm(qwen2_dir):
    directory = ModelDir.open(qwen2_dir)
    directory.check()
    names = set(directory.layout().shapes)
    assert {f"model.layers.1.self_attn.{p}_proj.bias" for p in "qkv"} <= names
    assert not {name for name in names if "q_norm" in name or "k_norm" in name or "o_proj.bias" in name}


@pytest.mark.parametrize(("case", "how", "fragments"), QWEN2_CASES, ids=[c[0] for c in QWEN2_CASES])
def test_a_qwen2_directory_that_disagrees_with_its_config_is_refused(qwen2_dir, tmp_path, case, how, fragments):
    model_dir = broken_copy(qwen2_dir, tmp_path, how)
    refused_alike(model_dir, fragments)
    with pytest.raises(DeployRefused, match="retriever.model_dir: ") as err:
        build_app(AppArgs(retriever={"model_dir": str(model_dir)}))
    assert fragments[0] in str(err.value)


@pytest.mark.parametrize(
    ("source", "labelled", "fragments"),
    [
        ("qwen3", "qwen2", ["lack 6 tensors", "model.layers.0.self_attn.k_proj.bias"]),
        ("qwen2", "qwen3", ["lack 4 tensors", "model.layers.0.self_attn.k_norm.weight"]),
    ],
)
def test_a_checkpoint_of_the_other_architecture_is_refused_naming_what_it_lacks(
    qwen3_dir, qwen2_dir, tmp_path, source, labelled, fragments
):
    """A Qwen3 checkpoint whose config.json says qwen2 lacks the biases; a Qwen2 one that says qwen3, the q/k norms."""
    model_dir = shutil.copytree(qwen3_dir if source == "qwen3" else qwen2_dir, tmp_path / "relabelled")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"model_type": labelled}))
    refused_alike(model_dir, fragments)


def test_the_error_names_the_shard_that_holds_the_tensor(qwen3_dir, tmp_path):
    model_dir = shutil.copytree(qwen3_dir, tmp_path / "sharded")
    tensors = load_file(str(model_dir / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(model_dir / shard))
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    (model_dir / "model.safetensors").unlink()
    ModelDir.open(model_dir).check()  # sharded and whole alike
    name = names[1]  # in the second shard
    second = {k: tensors[k][:1] if k == name else tensors[k] for k in names[1::2]}
    save_file(second, str(model_dir / "model-00002-of-00002.safetensors"))
    message = refused_alike(model_dir, [name, "model-00002-of-00002.safetensors", "implies shape"])
    assert message.startswith(f"{model_dir / 'model-00002-of-00002.safetensors'}: tensor {name} has shape")


@pytest.mark.parametrize("tie", [True, False])
def test_tied_embeddings_may_leave_out_the_head_and_untied_ones_may_not(tmp_path, tie):
    model_dir = write_model_dir(tmp_path / "m", ModelSpec(items=40, levels=2, codebook=8, tie_word_embeddings=tie))
    directory = ModelDir.open(model_dir)
    directory.check()
    if tie:  # the writer leaves the head out; the embedding stands in for it, and its shape is checked for both
        assert "lm_head.weight" not in load_file(str(model_dir / "model.safetensors"))
        edit_tensors(
            model_dir, lambda t: t.__setitem__("model.embed_tokens.weight", t["model.embed_tokens.weight"][:-1])
        )
        refused_alike(model_dir, ["model.embed_tokens.weight", "implies shape"])
    else:
        edit_tensors(model_dir, drop("lm_head.weight"))
        refused_alike(model_dir, ["lack 1 tensors", "lm_head.weight"])


def test_a_qwen3_checkpoint_may_hold_tensors_it_does_not_use(qwen3_dir, tmp_path):
    """As transformers loads it (an HSTU checkpoint may not: its writer never adds any)."""
    model_dir = shutil.copytree(qwen3_dir, tmp_path / "extra")
    edit_tensors(model_dir, add("model.rotary_emb.inv_freq"))
    ModelDir.open(model_dir).check()
    ModelDir.open(model_dir).load_model()


# -- `genrec.serving.check --model` ------------------------------------------------------------------------------


def test_check_model_refuses_a_ranker_that_disagrees_with_its_config(hstu_dir, qwen3_dir, tmp_path, capsys):
    grown = broken_copy(hstu_dir, tmp_path, {"num_items": 40})
    app = {"name": "funnel", "route_prefix": "/", "import_path": check.BUILDER}
    app["args"] = {"retriever": {"model_dir": str(qwen3_dir)}, "ranker": {"model_dir": str(grown)}}
    config = tmp_path / "funnel.yaml"
    config.write_text(yaml.safe_dump({"applications": [app]}))
    assert check.main([str(config)]) == 0  # without --model the directories are not read
    capsys.readouterr()
    assert check.main([str(config), "--model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {config}: applications[0].args.ranker.model_dir: ")
    assert "item_embedding.weight has shape [60, 16]" in err and "implies shape [100, 16]" in err


# -- the batch driver --------------------------------------------------------------------------------------------


def job(script: str, *flags, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "jobs" / script), *map(str, flags), "--no-progress"]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def refused_by_the_driver(done: subprocess.CompletedProcess, out: Path, *fragments: str) -> None:
    """Exit 2, one `error:` line saying `fragments`, no Ray started and nothing written."""
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr[-3000:]
    for fragment in fragments:
        assert fragment in done.stderr, done.stderr
    assert "Started a local Ray instance" not in done.stderr and not out.exists()


@pytest.fixture(scope="module")
def funnel_users(tmp_path_factory):
    path = tmp_path_factory.mktemp("users") / "users.parquet"
    event = pa.struct([("item_id", pa.string()), ("action", pa.int64()), ("timestamp", pa.float64())])
    schema = pa.schema([("user_id", pa.string()), ("prompt", pa.string()), ("history", pa.list_(event))])
    history = [{"item_id": "item-000001", "action": 0, "timestamp": 1.7e9}]
    pq.write_table(pa.Table.from_pylist([{"user_id": "u1", "prompt": "user likes", "history": history}], schema), path)
    return path


def test_the_batch_funnel_refuses_a_ranker_that_disagrees_with_its_config(qwen3_dir, hstu_dir, funnel_users, tmp_path):
    grown, out = broken_copy(hstu_dir, tmp_path, {"num_items": 40}), tmp_path / "out"
    flags = ["--model", qwen3_dir, "--ranker", grown, "--users", funnel_users, "--out", out, "--beam-width", "4"]
    done = job("batch_recommend.py", *flags, cwd=tmp_path)
    refused_by_the_driver(done, out, f"{grown / 'model.safetensors'}: tensor item_embedding.weight", "[100, 16]")


def test_the_batch_jobs_refuse_a_model_that_disagrees_with_its_config(qwen3_dir, hstu_dir, funnel_users, tmp_path):
    out = tmp_path / "out"
    model = broken_copy(qwen3_dir, tmp_path, to_int("model.norm.weight"))
    done = job("batch_recommend.py", "--model", model, "--users", funnel_users, "--out", out, cwd=tmp_path)
    refused_by_the_driver(done, out, "model.norm.weight", "torch.int32", "floating point")
    ranker = broken_copy(hstu_dir, tmp_path / "r", drop("final_norm.bias"))
    done = job("batch_rank.py", "--model", ranker, "--users", funnel_users, "--out", out, cwd=tmp_path)
    refused_by_the_driver(done, out, "lack 1 tensors", "final_norm.bias")
