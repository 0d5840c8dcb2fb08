"""Plain-Python views of the catalog, for the baselines' constrained decoding and the tests (never served)."""

from __future__ import annotations

import numpy as np


def item_sequences(catalog, ending=()) -> list[list[int]]:
    """Every item's tokens as the decode generates them: its code, then the layout's ending tokens."""
    return [[*catalog.code(i), *ending] for i in range(len(catalog))]


def allowed_tokens_fn(codes):
    """prefix (list of token IDs) -> allowed next tokens, as transformers' prefix_allowed_tokens_fn wants.
    `codes`: a [N, D] matrix or rows of token IDs of any lengths."""
    rows = codes.tolist() if isinstance(codes, np.ndarray) else [list(c) for c in codes]
    table: dict[tuple[int, ...], set[int]] = {}
    for code in rows:
        for level in range(len(code)):
            table.setdefault(tuple(code[:level]), set()).add(code[level])
    frozen = {prefix: sorted(tokens) for prefix, tokens in table.items()}

    def allowed(prefix: list[int]) -> list[int]:
        return frozen.get(tuple(prefix), [])

    return allowed
