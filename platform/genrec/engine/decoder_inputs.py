"""Turn a request's prompt into token IDs, validated against the model."""

from __future__ import annotations

import torch

from genrec.api import PromptInput
from genrec.errors import InvalidRequestError

# No token of a real tokenizer spans more characters than this: text longer than limit x this cannot fit,
# and is refused before tokenizing it (tokenizing megabytes would stall every other request).
MAX_CHARS_PER_TOKEN = 64


def check_text_fits(field: str, text: str, max_tokens: int) -> None:
    if len(text) > max_tokens * MAX_CHARS_PER_TOKEN:
        raise InvalidRequestError(
            field, f"{len(text)} characters cannot fit in the {max_tokens} tokens left for it (refused untokenized)"
        )


def prompt_token_ids(req: PromptInput, tokenizer, vocab_size: int, max_len: int) -> torch.Tensor:
    if req.prompt is not None:
        check_text_fits("prompt", req.prompt, max_len)
        ids = tokenizer(req.prompt, add_special_tokens=False)["input_ids"]
        field = "prompt"
    else:
        ids = req.prompt_token_ids
        field = "prompt_token_ids"
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(field, f"token IDs {bad[:5]} are outside the vocabulary (size {vocab_size})")
    if not ids:
        raise InvalidRequestError(field, "the prompt has no tokens")
    if len(ids) > max_len:
        raise InvalidRequestError(field, f"the prompt has {len(ids)} tokens; this model serves at most {max_len}")
    return torch.tensor(ids, dtype=torch.int64)
