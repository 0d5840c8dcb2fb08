"""Small tokenizers in the SID naming and token-ID order of the open checkpoints (facts in
shared/notes/open-checkpoints.md), written by our own code on genrec's tiny BPE base."""

from __future__ import annotations

from genrec.model.tokenizer import EOS_TOKEN
from genrec.testing.tiny import build_tokenizer

LETTERS = "abcd"


def genrec_tokenizer(levels: int = 3, codebook: int = 8):
    """genrec's own: `<a_N>` levels, each a contiguous ID range in numeric order."""
    return build_tokenizer(levels, codebook)


def openonerec_tokenizer(levels: int = 3, codebook: int = 8):
    """OpenOneRec: `<s_a_N>` tokens appended in numeric order, then `<|sid_begin|>` / `<|sid_end|>`; labels 是 / 否."""
    tok = build_tokenizer(0, 0)
    tok.add_tokens(["是", "否"])
    tok.add_tokens([f"<s_{LETTERS[level]}_{i}>" for level in range(levels) for i in range(codebook)])
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|sid_begin|>", "<|sid_end|>"]})
    return tok


def minionerec_tokenizer(codes: list[list[str]]):
    """MiniOneRec: the codes' tokens added as `add_tokens(sorted(set(...)))`: IDs in string order, only the codes
    that occur. `codes`: token-name lists (3 or 4 tokens)."""
    tok = build_tokenizer(0, 0)
    tok.add_tokens(sorted({name for code in codes for name in code}))
    assert tok.eos_token == EOS_TOKEN
    return tok
