"""The demo's prompt, in the layout that reuses: the semantic-ID tokens of the user's history, then `<|user|>`.

History first, oldest first; when it outgrows `length` items it is cut from the front in steps of a fifth of
that, not one item at a time, so a returning user's next prompt starts like the last one and the engine reuses
its cached K/V (see docs/engine.md, "Prompt layouts that reuse"). The soft token (the user's SVD factor) comes last: it
also marks "the next item follows", which is what retrieval generates from and what a scored candidate follows.
Inside the history an item's code is followed by the next item's code, so the model can tell a history item
from a candidate.
"""

from __future__ import annotations

import numpy as np


def window_start(items: int, length: int) -> int:
    """Where the prompt's history starts: the first multiple of length // 5 that leaves at most `length` items."""
    step = max(length // 5, 1)
    return max(0, -(-(items - length) // step) * step)


def prompt_token_ids(codes: np.ndarray, history: np.ndarray, user_token_id: int, length: int) -> np.ndarray:
    """codes [items, levels] token IDs; history item indices, oldest first; at most `length` items are used."""
    recent = codes[history[window_start(len(history), length) :]].reshape(-1)
    return np.concatenate([recent, [user_token_id]]).astype(np.int64)


def prompt_text(tokenizer, token_ids: np.ndarray) -> str:
    """The same prompt as text (every token is an added token, so text and IDs round-trip exactly)."""
    return tokenizer.decode(token_ids.tolist())
