"""The tiny checkpoints are in their projects' exact layouts (facts: shared/notes/open-checkpoints.md), and
transformers loads them as the architecture each project uses."""

import json

import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from genrec.testing.open_layouts import SID_BEGIN, SID_END, alpaca_prompt, openonerec_prompt
from tests.open_checkpoints import OPEN_SPEC


def test_openonerec_vocabulary_is_base_then_sid_tokens_in_numeric_order_then_wrappers(openonerec):
    tok = AutoTokenizer.from_pretrained(str(openonerec.model_dir))
    vocab = tok.get_vocab()
    first = vocab["<s_a_0>"]
    names = [f"<s_{level}_{i}>" for level in "abc" for i in range(OPEN_SPEC.codebook)]
    assert [vocab[n] for n in names] == list(range(first, first + len(names)))
    assert first > max(vocab[t] for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "</think>"))
    assert [vocab[SID_BEGIN], vocab[SID_END]] == [first + len(names), first + len(names) + 1]
    config = json.loads((openonerec.model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["vocab_size"] % 256 == 0
    assert config["vocab_size"] >= len(tok) > config["vocab_size"] - 256
    for label in ("是", "否"):
        assert len(tok(label, add_special_tokens=False)["input_ids"]) == 1


def test_openonerec_prompt_has_system_turn_empty_think_block_and_ends_with_sid_begin(openonerec):
    tok = AutoTokenizer.from_pretrained(str(openonerec.model_dir))
    history = [openonerec.codes["1000"], openonerec.codes["1001"]]
    ids = openonerec_prompt(tok, history)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n") and "/no_think<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n<|sid_begin|>")
    assert ids[-1] == tok.convert_tokens_to_ids(SID_BEGIN)
    thinking = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)
    assert thinking.endswith("<|im_start|>assistant\n")  # the switch is the template's, not hard-wired


def test_openonerec_pid2sid_has_integer_pids_three_level_sids_and_shared_codes(openonerec):
    table = pq.read_table(openonerec.item_map)
    assert table.column_names == ["pid", "sid"]
    sids = [tuple(s) for s in table.column("sid").to_pylist()]
    assert all(len(s) == 3 and all(0 <= c < OPEN_SPEC.codebook for c in s) for s in sids)
    assert len(set(sids)) < len(sids)  # some codes name several pids
    assert all(isinstance(p, int) for p in table.column("pid").to_pylist())


def test_minionerec_tokens_follow_string_order_only_occurring_codes_and_d_only_on_collisions(minionerec):
    tok = AutoTokenizer.from_pretrained(str(minionerec.model_dir))
    vocab = tok.get_vocab()
    occurring = sorted({t for code in minionerec.codes.values() for t in code})
    assert [vocab[t] for t in occurring] == list(range(vocab[occurring[0]], vocab[occurring[0]] + len(occurring)))
    a_level = [t for t in occurring if t.startswith("<a_")]
    assert a_level != sorted(a_level, key=lambda t: int(t[3:-1]))  # string order is not numeric order
    assert len(a_level) < OPEN_SPEC.codebook  # a level holds only the codes that occur
    by_prefix = {}
    for code in minionerec.codes.values():
        by_prefix.setdefault(tuple(code[:3]), []).append(code)
    for prefix, codes in by_prefix.items():
        if len(codes) == 1:
            assert len(codes[0]) == 3, prefix
        else:
            assert sorted(c[3] for c in codes) == [f"<d_{k}>" for k in range(len(codes))], prefix
    assert any(len(codes) > 1 for codes in by_prefix.values())
    assert len(tok("\n", add_special_tokens=False)["input_ids"]) == 1
    assert alpaca_prompt([minionerec.codes["0"]]).endswith("### Response:\n")


def test_minionerec_is_qwen2_with_qkv_biases_and_no_qk_norm(minionerec):
    config = json.loads((minionerec.model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["vocab_size"] % 256 == 0
    with safe_open(str(minionerec.model_dir / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    assert {f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"} <= names
    assert not any("q_norm" in n or "k_norm" in n for n in names)
    model, info = AutoModelForCausalLM.from_pretrained(
        str(minionerec.model_dir), dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))


@pytest.mark.parametrize("which", ["openonerec", "minionerec"])
def test_written_checkpoints_are_deterministic(which, tmp_path, request):
    from genrec.testing import open_layouts

    written = request.getfixturevalue(which)
    again = getattr(open_layouts, f"write_{which}_dir")(tmp_path / "again", OPEN_SPEC)
    for name in ("model.safetensors", "tokenizer.json", written.item_map.name):
        assert (again.model_dir / name).read_bytes() == (written.model_dir / name).read_bytes(), name
