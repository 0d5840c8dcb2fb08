"""Tiny random-weight checkpoints laid out exactly as OpenOneRec and MiniOneRec ship theirs (`write_openonerec_dir`,
`write_minionerec_dir`), and NVIDIA SID-GR's JSONL catalog (`write_sidgr_jsonl`): our own code, from the layouts'
published facts (docs/open-checkpoints.md), used by the tests and the docs' walkthrough in place of a download.
Neither writer writes genrec's catalog: `genrec catalog import` makes it from the item-map file, as a user would.

- OpenOneRec: Qwen3; a base vocabulary, then `<s_a_N>`, `<s_b_N>`, `<s_c_N>` in numeric order, then `<|sid_begin|>`,
  `<|sid_end|>`; the vocabulary padded to a multiple of 256; a Qwen3-style chat template (system prompt, thinking
  switch); labels `是` / `否`; `pid2sid.parquet` (`pid`, `sid`: 3 ints) with shared codes.
- MiniOneRec: Qwen2; tokens added with `add_tokens(sorted(set(...)))` (string order, only the codes that occur);
  `<d_k>` only on colliding items; answers end with `\\n` then EOS; `*.index.json`; Alpaca-style text prompts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import save
from transformers import PreTrainedTokenizerFast

from genrec.files import write_atomically
from genrec.testing.tiny import decoder_config, random_weights, trained_bpe

SID_BEGIN, SID_END = "<|sid_begin|>", "<|sid_end|>"
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK_TOKENS = ("<think>", "</think>")
OPENONEREC_LABELS = ("是", "否")
OPENONEREC_LEVELS = ("s_a", "s_b", "s_c")
MINIONEREC_LEVELS = ("a", "b", "c", "d")
VOCAB_MULTIPLE = 256
OPENONEREC_SYSTEM_PROMPT = "你是一个推荐助手。根据用户看过的视频，推荐用户接下来可能看的视频。"

# A Qwen3-style chat template (our own text): a turn per message, and, when a reply is asked for, the assistant
# turn opened; `enable_thinking=false` puts the empty think block there, as Qwen3 does.
QWEN3_STYLE_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
)

_WORDS = (
    "user watched video item history recent next recommend the a and of to in is was yes no instruction input "
    "response interacted with items has below predict which one will buy"
).split()
_CHINESE = ("是", "否", "用户", "视频", "推荐", "看过", "接下来", "可能", "你", "一个", "助手", "根据", "的")


@dataclass(frozen=True)
class OpenLayoutSpec:
    """A tiny checkpoint's shape. `codebook` codes per level (3 levels); `shared` items reuse an earlier item's code
    (OpenOneRec: shared codes; MiniOneRec: collisions, disambiguated by a 4th `<d_k>` token)."""

    items: int = 120
    codebook: int = 16
    shared: int = 12
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    max_positions: int = 4096
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.shared < self.items:
            raise ValueError(f"open layout spec: shared must be in [1, items), not {self.shared}")
        if self.items - self.shared > self.codebook**3:
            raise ValueError(
                f"open layout spec: {self.items - self.shared} distinct codes do not fit {self.codebook}^3"
            )


@dataclass(frozen=True)
class WrittenCheckpoint:
    model_dir: Path
    item_map: Path  # pid2sid.parquet or *.index.json: the file `genrec catalog import` reads
    codes: dict[str, list[str]]  # item ID -> the code's token names (no wrappers or endings), as the map says


# -- OpenOneRec ----------------------------------------------------------------------------------------------------


def write_openonerec_dir(out: str | Path, spec: OpenLayoutSpec = OpenLayoutSpec()) -> WrittenCheckpoint:
    """A Qwen3 checkpoint in OpenOneRec's layout, and its `pid2sid.parquet` beside the model's files."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = base_tokenizer([ENDOFTEXT, IM_START, IM_END], spec.seed, chinese=True)
    tokenizer.add_tokens(list(THINK_TOKENS))
    tokenizer.add_tokens([f"<{level}_{i}>" for level in OPENONEREC_LEVELS for i in range(spec.codebook)])
    tokenizer.add_tokens([SID_BEGIN, SID_END])
    for label in OPENONEREC_LABELS:
        _check_one_token(tokenizer, label)
    tokenizer.chat_template = QWEN3_STYLE_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out))

    _write_decoder(out, spec, _padded(len(tokenizer)), tokenizer.convert_tokens_to_ids(IM_END), "qwen3")

    sids = _shared_codes(spec)
    pids = list(range(1000, 1000 + spec.items))  # OpenOneRec's pids are integers
    table = pa.table({"pid": pa.array(pids, pa.int64()), "sid": pa.array(sids.tolist(), pa.list_(pa.int64()))})
    pq.write_table(table, out / "pid2sid.parquet")
    codes = {
        str(pid): [f"<{lv}_{c}>" for lv, c in zip(OPENONEREC_LEVELS, sid, strict=True)]
        for pid, sid in zip(pids, sids.tolist(), strict=True)
    }
    return WrittenCheckpoint(out, out / "pid2sid.parquet", codes)


def openonerec_messages(history: list[list[str]], system: str = OPENONEREC_SYSTEM_PROMPT) -> list[dict]:
    """Chat messages as OpenOneRec's recommendation task writes them: the history as wrapped codes, `/no_think`."""
    watched = "".join(SID_BEGIN + "".join(code) + SID_END for code in history)
    return [{"role": "system", "content": system}, {"role": "user", "content": f"用户看过的视频：{watched}/no_think"}]


def openonerec_prompt(tokenizer, history: list[list[str]]) -> list[int]:
    """The prompt's token IDs as OpenOneRec's evaluation builds it: the chat template with thinking off, then
    `<|sid_begin|>` appended (the code starts after it)."""
    text = tokenizer.apply_chat_template(
        openonerec_messages(history), tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    return tokenizer(text + SID_BEGIN, add_special_tokens=False)["input_ids"]


def _shared_codes(spec: OpenLayoutSpec) -> np.ndarray:
    """[items, 3] per-level indexes: distinct codes, then `shared` rows that repeat one of them."""
    distinct = spec.items - spec.shared
    rng = np.random.default_rng(spec.seed)
    flat = rng.choice(spec.codebook**3, size=distinct, replace=False)
    codes = np.stack([flat // spec.codebook**2, (flat // spec.codebook) % spec.codebook, flat % spec.codebook], 1)
    repeats = codes[rng.integers(0, distinct, size=spec.shared)]
    order = rng.permutation(spec.items)  # shared rows are spread over the map, not all at its end
    return np.concatenate([codes, repeats])[order]


# -- MiniOneRec ----------------------------------------------------------------------------------------------------


def write_minionerec_dir(
    out: str | Path, spec: OpenLayoutSpec = OpenLayoutSpec(), name: str = "Toys"
) -> WrittenCheckpoint:
    """A Qwen2 checkpoint in MiniOneRec's layout, and its `{name}.index.json` beside the model's files."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    index = _minionerec_index(spec)
    tokenizer = base_tokenizer([ENDOFTEXT, IM_START, IM_END], spec.seed, chinese=False)
    tokenizer.add_tokens(sorted({token for code in index.values() for token in code}))  # string order, as theirs
    for label in ("yes", "no", "\n"):
        _check_one_token(tokenizer, label)
    tokenizer.save_pretrained(str(out))
    _write_decoder(out, spec, _padded(len(tokenizer)), tokenizer.eos_token_id, "qwen2")  # Qwen2.5: untied
    (out / f"{name}.index.json").write_text(json.dumps(index, indent=1))
    return WrittenCheckpoint(out, out / f"{name}.index.json", index)


def alpaca_prompt(history: list[list[str]]) -> str:
    """An Alpaca-style text prompt as MiniOneRec's SFT data writes it; the answer follows `### Response:\\n`."""
    items = ", ".join("".join(code) for code in history)
    return (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nCan you predict the next item the user will buy?\n\n"
        f"### User Input:\nThe user has interacted with items {items} in chronological order.\n\n### Response:\n"
    )


def _minionerec_index(spec: OpenLayoutSpec) -> dict[str, list[str]]:
    """{"0": ["<a_..>", "<b_..>", "<c_..>"(, "<d_k>")]}: levels a and b use only part of the codebook (sparse,
    as theirs), and every item of a colliding group gets `<d_0>`, `<d_1>`, ... (the others keep 3 tokens)."""
    rng = np.random.default_rng(spec.seed)
    sizes = (max(2, spec.codebook * 3 // 4), max(2, spec.codebook * 7 // 8), spec.codebook)
    used = [np.sort(rng.choice(spec.codebook, size=size, replace=False)) for size in sizes]
    space = math.prod(sizes)
    distinct = spec.items - spec.shared
    if distinct > space:
        raise ValueError(f"open layout spec: {distinct} distinct codes do not fit the sparse levels ({space})")
    flat = rng.choice(space, size=distinct, replace=False)
    digits = np.stack([flat // (sizes[1] * sizes[2]), (flat // sizes[2]) % sizes[1], flat % sizes[2]], 1)
    codes = np.stack([used[level][digits[:, level]] for level in range(3)], 1)
    codes = np.concatenate([codes, codes[rng.integers(0, distinct, size=spec.shared)]])[rng.permutation(spec.items)]
    groups: dict[tuple, list[int]] = {}
    for item, code in enumerate(map(tuple, codes.tolist())):
        groups.setdefault(code, []).append(item)
    index = {}
    for code, items in groups.items():
        names = [f"<{MINIONEREC_LEVELS[level]}_{c}>" for level, c in enumerate(code)]
        for k, item in enumerate(items):
            index[str(item)] = names + ([f"<d_{k}>"] if len(items) > 1 else [])
    return dict(sorted(index.items(), key=lambda kv: int(kv[0])))


def _write_decoder(out: Path, spec: OpenLayoutSpec, vocab_size: int, eos_token_id: int, architecture: str) -> None:
    """config.json (the architecture's own keys, as transformers writes them) and peaked random weights under
    transformers' names: genrec.testing.tiny's, so a Qwen2 has its q/k/v biases and no q/k norm."""
    config = decoder_config(spec, vocab_size, architecture, tie_word_embeddings=False)
    body = config.to_hf_dict()
    body.update(bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None)
    (out / "config.json").write_text(json.dumps(body, indent=2))
    generator = torch.Generator().manual_seed(spec.seed)
    weights = random_weights(config, generator, torch.float32)
    write_atomically(out / "model.safetensors", save(weights, {"format": "pt"}))


# -- NVIDIA SID-GR's JSONL catalog ---------------------------------------------------------------------------------


def write_sidgr_jsonl(path: str | Path, rows: list[tuple[str, list[int]]], metadata: dict | None = None) -> Path:
    """One JSON object per line: `{"item_id", "token_ids": [raw token IDs], "metadata"}`."""
    path = Path(path)
    lines = [json.dumps({"item_id": item, "token_ids": list(ids), "metadata": metadata or {}}) for item, ids in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


# -- shared pieces -------------------------------------------------------------------------------------------------


def base_tokenizer(specials: list[str], seed: int, chinese: bool) -> PreTrainedTokenizerFast:
    """A small deterministic byte-level BPE standing in for a Qwen base vocabulary: `specials` first (the first is
    EOS and padding), ordinary words, `\\n` one token; with `chinese`, the label characters one token each."""
    return trained_bpe(specials, 700, _WORDS + (list(_CHINESE) * 4 if chinese else []), seed)


def _check_one_token(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"the tiny base vocabulary splits {text!r} into {len(ids)} tokens; it must be one")


def _padded(size: int) -> int:
    return -(-size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
