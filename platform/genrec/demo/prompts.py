"""The demo's prompt: `<|user|>` + the semantic-ID tokens of the user's last items + `<|user|>`.

The soft token carries the user's SVD factor in both placeholders; the closing one also marks "the next item
follows", which is what retrieval generates from and what a scored candidate follows. Inside the history an
item's code is followed by the next item's code, so the model can tell a history item from a candidate.
"""

from __future__ import annotations

import numpy as np


def prompt_token_ids(codes: np.ndarray, history: np.ndarray, user_token_id: int, length: int) -> np.ndarray:
    """codes [items, levels] token IDs; history item indices, oldest first; the last `length` items are used."""
    recent = codes[history[-length:]].reshape(-1)
    return np.concatenate([[user_token_id], recent, [user_token_id]]).astype(np.int64)


def prompt_text(tokenizer, token_ids: np.ndarray) -> str:
    """The same prompt as text (every token is an added token, so text and IDs round-trip exactly)."""
    return tokenizer.decode(token_ids.tolist())
