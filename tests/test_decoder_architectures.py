"""The decoder's two architectures as config.json says them: Qwen3 and Qwen2 (Qwen2.5, MiniOneRec's base).

What is read (q/k/v biases, q/k norm, a sliding window only when it is off), what is refused and how it is named.
Their numerics against transformers are in tests/test_model.py and the engine tests that take `arch_engine`; the
preflight's tensor check in tests/test_model_shapes.py.
"""

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from genrec.api import RetrieveRequest
from genrec.cli import app
from genrec.engine import Engine
from genrec.errors import ModelDirectoryError
from genrec.model.config import Qwen3Config
from genrec.model.directory import ModelDir
from genrec.model.qwen3 import ContextKV, checkpoint_layout, meta_qwen3
from genrec.testing.tiny import ModelSpec, write_model_dir

# The keys a Qwen2.5-0.5B config.json carries, with its shapes (head_dim left out: hidden / heads).
QWEN25_SHAPED = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_a_qwen25_shaped_config_reads_as_qwen2_with_biases_and_no_qk_norm():
    config = Qwen3Config.from_dict(QWEN25_SHAPED)
    assert (config.architecture, config.head_dim, config.qkv_bias, config.attention_bias) == ("qwen2", 64, True, False)
    assert config.tie_word_embeddings
    shapes = checkpoint_layout(meta_qwen3(config)).shapes
    assert shapes["model.layers.23.self_attn.q_proj.bias"] == (896,)
    assert shapes["model.layers.23.self_attn.k_proj.bias"] == (128,)
    assert "model.layers.0.self_attn.o_proj.bias" not in shapes
    assert not [name for name in shapes if "_norm" in name and "self_attn" in name]


def test_a_qwen3_config_keeps_its_qk_norm_and_no_biases():
    config = Qwen3Config.from_dict(QWEN25_SHAPED | {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})
    shapes = checkpoint_layout(meta_qwen3(config)).shapes
    assert config.architecture == "qwen3" and not config.qkv_bias
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (64,)
    assert not [name for name in shapes if name.endswith(".bias")]


@pytest.mark.parametrize(
    "changes, fragments",
    [
        ({"use_sliding_window": True}, ["use_sliding_window is true", "sliding_window 32768", "max_window_layers 24"]),
        ({"layer_types": ["full_attention"] * 20 + ["sliding_attention"] * 4}, ["layer_types[20]", "sliding"]),
        ({"layer_types": "full_attention"}, ["layer_types must be a list"]),
        ({"model_type": "llama"}, ["'llama'", "qwen3", "qwen2"]),
    ],
    ids=["window on", "sliding layers", "layer_types not a list", "another model type"],
)
def test_what_is_not_a_full_attention_qwen_decoder_is_refused_by_name(changes, fragments):
    with pytest.raises(ModelDirectoryError) as err:
        Qwen3Config.from_dict(QWEN25_SHAPED | changes, "model/config.json")
    assert str(err.value).startswith("model/config.json: ")
    for fragment in fragments:
        assert fragment in str(err.value)


def test_a_window_that_is_off_is_accepted_whatever_its_size():
    config = Qwen3Config.from_dict(QWEN25_SHAPED | {"sliding_window": 4096, "max_window_layers": 2})
    full = Qwen3Config.from_dict(QWEN25_SHAPED | {"layer_types": ["full_attention"] * 24})
    assert config == full == Qwen3Config.from_dict(QWEN25_SHAPED)


def test_an_unknown_architecture_or_an_odd_qwen2_shape_is_refused():
    with pytest.raises(ValueError, match="architecture must be one of"):
        ModelSpec(architecture="llama")
    with pytest.raises(ValueError, match="architecture must be one of"):
        Qwen3Config(8, 8, 8, 1, 1, 1, 8, architecture="llama")
    with pytest.raises(ValueError, match="heads x head_dim = hidden, not 4 x 32 != 64"):
        ModelSpec(architecture="qwen2", head_dim=32)


def test_a_window_turned_on_refuses_the_directory_at_open(tmp_path):
    model_dir = write_model_dir(tmp_path / "m", ModelSpec(items=20, levels=2, codebook=8, architecture="qwen2"))
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["use_sliding_window"]) == (
        "qwen2",
        ["Qwen2ForCausalLM"],
        False,
    )
    (model_dir / "config.json").write_text(json.dumps(config | {"use_sliding_window": True}))
    with pytest.raises(ModelDirectoryError, match="use_sliding_window is true") as err:
        Engine.from_pretrained(model_dir)
    assert str(err.value).startswith(str(model_dir / "config.json"))


def test_qwen2_ignores_attention_bias_as_transformers_does(tmp_path, rng):
    """Qwen2's output projection has no bias whatever config.json says; q/k/v have theirs either way."""
    from transformers import AutoModelForCausalLM

    source = write_model_dir(tmp_path / "m", ModelSpec(items=20, levels=2, codebook=8, architecture="qwen2"))
    model_dir = shutil.copytree(source, tmp_path / "with-attention-bias")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"attention_bias": True}))
    directory = ModelDir.open(model_dir)
    directory.check()
    ours = directory.load_model()
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.vocab_size, (19,), generator=rng)
    ctx = ContextKV.allocate(ours.config, len(ids), "cpu", torch.float32)
    logits = ours.prefill(ours.embed(ids), ctx, logits_at=torch.arange(len(ids)))
    with torch.no_grad():
        assert (logits - hf(ids[None]).logits[0]).abs().max().item() <= 1e-4


def test_the_cli_writes_a_qwen2_directory_the_engine_serves(tmp_path):
    out = tmp_path / "qwen2"
    args = ["tiny-model", str(out), "--items", "30", "--levels", "2", "--codebook", "8", "--architecture", "qwen2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    engine = Engine.from_pretrained(out)
    assert engine.model.config.architecture == engine.family.describe()["architecture"] == "qwen2"  # /v1/model's
    (found,) = engine.retrieve([RetrieveRequest(prompt="a user", beam_width=4)])
    assert len(found.items) == 4


def test_the_cli_refuses_an_architecture_it_does_not_know_or_an_hstu_one(tmp_path):
    result = CliRunner().invoke(app, ["tiny-model", str(tmp_path / "a"), "--architecture", "llama"])
    assert result.exit_code != 0 and "architecture must be one of" in str(result.exception or result.output)
    result = CliRunner().invoke(app, ["tiny-model", str(tmp_path / "b"), "--family", "hstu", "--architecture", "qwen2"])
    assert result.exit_code == 2 and "--architecture" in result.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
