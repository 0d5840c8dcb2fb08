"""Tokenizer conventions: semantic-ID tokens, the soft-token placeholder, label tokens.

genrec's own models name their semantic-ID tokens `<{letter}_{index}>`, one letter per code level (`<a_0>..<a_255>`,
`<b_0>..`); which tokens form each level of a model is its SID layout (genrec.model.sid_layout). `<|user|>` is the
soft-token placeholder.
"""

from __future__ import annotations

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
