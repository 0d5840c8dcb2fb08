"""Plain-Python views of the catalog, for baselines and tests (never on the serving path)."""

from __future__ import annotations

import numpy as np


def allowed_tokens_fn(codes: np.ndarray):
    """prefix (list of token IDs) -> allowed next tokens, as transformers' prefix_allowed_tokens_fn wants."""
    table: dict[tuple[int, ...], set[int]] = {}
    for code in codes.tolist():
        for level in range(len(code)):
            table.setdefault(tuple(code[:level]), set()).add(code[level])
    frozen = {prefix: sorted(tokens) for prefix, tokens in table.items()}

    def allowed(prefix: list[int]) -> list[int]:
        return frozen.get(tuple(prefix), [])

    return allowed
