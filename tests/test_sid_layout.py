"""The SID layout read from the model: levels by name (any ID order, sparse), raw IDs, wrappers, labels, errors."""

import json

import numpy as np
import pytest

from genrec.errors import CatalogError, ModelDirectoryError
from genrec.model.sid_layout import SidLayout
from tests.sid_tokenizers import genrec_tokenizer, minionerec_tokenizer, openonerec_tokenizer

MINI_CODES = [["<a_0>", "<b_3>", "<c_7>"], ["<a_101>", "<b_3>", "<c_2>", "<d_0>"], ["<a_2>", "<b_250>", "<c_7>"]]


def test_genrec_names_inferred_as_contiguous_levels():
    tok = genrec_tokenizer(levels=3, codebook=8)
    layout = SidLayout.infer(tok)
    vocab = tok.get_vocab()
    assert layout.level_sizes == [8, 8, 8]
    for level, letter in enumerate("abc"):
        assert layout.level_ids[level].tolist() == [vocab[f"<{letter}_{i}>"] for i in range(8)]
    assert (layout.begin, layout.ending, layout.labels) == (None, (), ("yes", "no"))


def test_openonerec_names_and_wrappers_inferred():
    tok = openonerec_tokenizer(levels=3, codebook=8)
    layout = SidLayout.infer(tok)
    vocab = tok.get_vocab()
    assert layout.level_ids[2].tolist() == [vocab[f"<s_c_{i}>"] for i in range(8)]
    assert layout.begin == vocab["<|sid_begin|>"]
    assert layout.ending_kind == "end_token" and layout.ending == (vocab["<|sid_end|>"],)
    assert layout.labels == ("是", "否")
    # OpenOneRec's item map gives code indices: index -> token per level.
    assert layout.token_ids(1, [0, 5, 8]).tolist() == [vocab["<s_b_0>"], vocab["<s_b_5>"], -1]


def test_minionerec_string_order_sparse_levels_and_ending():
    tok = minionerec_tokenizer(MINI_CODES)
    vocab = tok.get_vocab()
    assert vocab["<a_101>"] < vocab["<a_2>"]  # the IDs follow string order
    layout = SidLayout.from_spec({"preset": "minionerec"}, tok, "sid_layout.json")
    assert layout.level_sizes == [3, 2, 2, 1]
    assert layout.level_indices[0].tolist() == [0, 2, 101]  # ordered by code index, not by ID
    assert layout.level_ids[0].tolist() == [vocab["<a_0>"], vocab["<a_2>"], vocab["<a_101>"]]
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    assert layout.ending_kind == "newline_eos" and layout.ending == (*newline, tok.eos_token_id)
    assert layout.level_of([vocab["<d_0>"], vocab["<a_101>"], vocab["yes"]]).tolist() == [3, 0, -1]


def test_layout_file_read_from_model_dir(tmp_path):
    tok = genrec_tokenizer(levels=2, codebook=4)
    vocab = tok.get_vocab()
    spec = {
        "levels": [{"pattern": "<b_{N}>"}, {"tokens": ["<a_3>", "<a_1>"]}],
        "ending": "eos",
        "labels": ["no", "yes"],
    }
    (tmp_path / "genrec").mkdir()
    (tmp_path / "genrec" / "sid_layout.json").write_text(json.dumps(spec))
    layout = SidLayout.for_model(tmp_path, tok)
    assert layout.level_ids[1].tolist() == [vocab["<a_3>"], vocab["<a_1>"]]
    assert layout.ending == (tok.eos_token_id,) and layout.labels == ("no", "yes")
    assert "sid_layout.json" in layout.source


def test_raw_token_id_levels_and_round_trip():
    tok = genrec_tokenizer(levels=2, codebook=4)
    first = tok.get_vocab()["<a_0>"]
    spec = {"levels": [{"first_id": first, "count": 4}, {"token_ids": [first + 7, first + 4]}], "ending": "none"}
    layout = SidLayout.from_spec(spec, tok, "raw")
    assert layout.level_ids[1].tolist() == [first + 7, first + 4]
    again = SidLayout.from_spec(layout.to_json(tok), tok, "again")
    assert [ids.tolist() for ids in again.level_ids] == [ids.tolist() for ids in layout.level_ids]
    openonerec = openonerec_tokenizer()
    body = SidLayout.infer(openonerec).to_json(openonerec)
    assert body["begin"] == "<|sid_begin|>" and body["end_token"] == "<|sid_end|>"
    assert SidLayout.from_spec(body, openonerec, "x").ending == SidLayout.infer(openonerec).ending


def test_catalog_codes_checked_against_the_levels():
    tok = minionerec_tokenizer(MINI_CODES)
    vocab = tok.get_vocab()
    layout = SidLayout.from_spec({"preset": "minionerec"}, tok, "x")
    ids = [[vocab[t] for t in code] for code in MINI_CODES]
    lengths = np.array([len(c) for c in ids])
    codes = np.full((3, 4), -1)
    for row, code in enumerate(ids):
        codes[row, : len(code)] = code
    layout.check_codes(codes, lengths, ["x", "y", "z"])
    swapped = codes.copy()
    swapped[2, [0, 1]] = swapped[2, [1, 0]]
    with pytest.raises(CatalogError, match=r"item 'z': token \d+ at position 0 belongs to level 1, not level 0"):
        layout.check_codes(swapped, lengths, ["x", "y", "z"])
    unknown = codes.copy()
    unknown[1, 3] = vocab["yes"]
    with pytest.raises(CatalogError, match="item 'y': .* position 3 is not a semantic-ID token"):
        layout.check_codes(unknown, lengths, ["x", "y", "z"])


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ({"preset": "nope"}, "preset 'nope'"),
        ({"levels": [{"pattern": "<z_{N}>"}]}, r"levels\[0\].pattern '<z_\{N\}>' matches no token"),
        ({"levels": [{"tokens": ["<a_0>", "<q_1>"]}]}, r"levels\[0\].tokens: \['<q_1>'\] not in the vocabulary"),
        ({"levels": [{"token_ids": [10**7]}]}, r"levels\[0\].token_ids: token IDs \[10000000\]"),
        ({"levels": [{"pattern": "<a_{N}>"}, {"pattern": "<a_{N}>"}]}, "belongs to level 0 and 1"),
        ({"preset": "genrec", "ending": "stop"}, "ending: 'stop'"),
        ({"preset": "genrec", "ending": "end_token"}, "needs 'end_token'"),
        ({"preset": "genrec", "begin": "<|nope|>"}, "begin: '<|nope|>' is not a token"),
        ({"preset": "genrec", "labels": ["yes", "podcast episode"]}, r"labels\[1\]: 'podcast episode' is not exactly"),
        ({"preset": "genrec", "labels": ["yes", "yes"]}, "the same token"),
        ({"preset": "genrec", "colour": 1}, r"unknown keys \['colour'\]"),
        ({"preset": "genrec", "version": 2}, "version 2"),
    ],
)
def test_bad_layouts_named(spec, problem):
    with pytest.raises(ModelDirectoryError, match=problem):
        SidLayout.from_spec(spec, genrec_tokenizer(levels=2, codebook=4), "sid_layout.json")


def test_level_letters_without_gaps():
    tok = genrec_tokenizer(levels=0, codebook=0)
    tok.add_tokens(["<a_0>", "<c_0>"])
    with pytest.raises(ModelDirectoryError, match="letters \\['c'\\] follow a missing letter 'b'"):
        SidLayout.infer(tok)
