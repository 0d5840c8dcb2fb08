"""Tokenizer conventions: semantic-ID tokens, the soft-token placeholder, label tokens.

genrec's own models name their semantic-ID tokens `<{letter}_{index}>`, one letter per code level (`<a_0>..<a_255>`,
`<b_0>..`); which tokens form each level of a model is its SID layout (genrec.model.sid_layout). `<|user|>` is the
soft-token placeholder.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

from genrec.errors import ModelDirectoryError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

USER_TOKEN = "<|user|>"
EOS_TOKEN = "<|endoftext|>"
LABEL_TOKENS = ("yes", "no")
LEVEL_LETTERS = string.ascii_lowercase


def semantic_token(level: int, index: int) -> str:
    return f"<{LEVEL_LETTERS[level]}_{index}>"


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    if not (model_dir / "tokenizer.json").exists() and not (model_dir / "tokenizer_config.json").exists():
        raise ModelDirectoryError(model_dir, "no tokenizer files (tokenizer.json / tokenizer_config.json)")
    from transformers import AutoTokenizer  # here: a process that only checks a model never imports transformers

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
