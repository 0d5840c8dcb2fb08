"""Tokenizer conventions: semantic-ID tokens, the soft-token placeholder, label tokens.

Semantic-ID tokens are ordinary added tokens named `<{letter}_{index}>`, one letter per code level
(`<a_0>..<a_255>`, `<b_0>..`), each level a contiguous ID range. `<|user|>` is the soft-token placeholder.
"""

from __future__ import annotations

import re
import string
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from genrec.errors import ModelDirectoryError

USER_TOKEN = "<|user|>"
EOS_TOKEN = "<|endoftext|>"
LABEL_TOKENS = ("yes", "no")
LEVEL_LETTERS = string.ascii_lowercase
_SEMANTIC = re.compile(r"^<([a-z])_(\d+)>$")


def semantic_token(level: int, index: int) -> str:
    return f"<{LEVEL_LETTERS[level]}_{index}>"


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    if not (model_dir / "tokenizer.json").exists() and not (model_dir / "tokenizer_config.json").exists():
        raise ModelDirectoryError(model_dir, "no tokenizer files (tokenizer.json / tokenizer_config.json)")
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as err:  # transformers raises many types here; report them as one clear error
        raise ModelDirectoryError(model_dir, f"tokenizer does not load ({type(err).__name__}: {err})") from None


def check_token_ids(tokenizer: PreTrainedTokenizerBase, vocab_size: int, model_dir: Path) -> None:
    """Every token ID the tokenizer can produce must index the model's embedding (else a device assert later)."""
    vocab = tokenizer.get_vocab()
    top = max(vocab.values(), default=-1)
    if top >= vocab_size:
        name = next(token for token, token_id in vocab.items() if token_id == top)
        raise ModelDirectoryError(
            model_dir, f"the tokenizer has token IDs up to {top} ({name!r}); config.json's vocab_size is {vocab_size}"
        )


def semantic_token_ranges(tokenizer: PreTrainedTokenizerBase) -> list[tuple[int, int]]:
    """Per level, the [first, last] token ID of its semantic-ID tokens; each level must be contiguous."""
    by_level: dict[int, dict[int, int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        match = _SEMANTIC.match(token)
        if match:
            level = LEVEL_LETTERS.index(match.group(1))
            by_level.setdefault(level, {})[int(match.group(2))] = token_id
    ranges = []
    for level in range(len(by_level)):
        if level not in by_level:
            raise ModelDirectoryError("tokenizer", f"semantic-ID level {LEVEL_LETTERS[level]!r} has no tokens")
        ids = by_level[level]
        first = ids.get(0)
        expected = [first + i for i in range(len(ids))] if first is not None else None
        if expected is None or [ids.get(i) for i in range(len(ids))] != expected:
            raise ModelDirectoryError(
                "tokenizer", f"semantic-ID tokens of level {LEVEL_LETTERS[level]!r} are not one contiguous ID range"
            )
        ranges.append((first, first + len(ids) - 1))
    return ranges


def build_tokenizer(levels: int, codebook: int, seed: int = 0, base_vocab: int = 600) -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer (deterministic) plus genrec's special and semantic-ID tokens."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=base_vocab,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS_TOKEN],
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(seed), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    tok.add_special_tokens({"additional_special_tokens": [USER_TOKEN]})
    tok.add_tokens(list(LABEL_TOKENS))
    tok.add_tokens([semantic_token(level, i) for level in range(levels) for i in range(codebook)])
    return tok


_WORDS = (
    "user listened to podcast episode show music artist album track liked skipped saved played followed "
    "recommend next item history recent genre news comedy sports science story daily weekly morning "
    "evening the a and of in on for with is was yes no"
).split()


def _corpus(seed: int, sentences: int = 400):
    rng = np.random.default_rng(seed)
    for _ in range(sentences):
        yield " ".join(rng.choice(_WORDS, size=int(rng.integers(4, 16))))
