"""The retrieve -> rank funnel's policy, once for the online app and the nightly job (no Ray, no I/O here).

Stage 1 (the Qwen3 retriever) finds a user's items in beam order; stage 2 (the HSTU ranker) ranks them after the
user's history. The two models' catalogs may differ: the ranker is asked about the items it knows only
(`known`), and the final order is `final_order`: the ranked items by the rank task's probability, highest first,
ties in stage 1's order; then the items the ranker could not rank, in stage 1's order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def known(item_ids: Sequence[str], knows: Callable[[str], bool]) -> list[str]:
    """The items the ranker's catalog holds, in stage 1's order: what it is asked to rank."""
    return [item for item in item_ids if knows(item)]


def final_order(item_ids: Sequence[str], scores: dict[str, dict[str, float]], task: str) -> list[int]:
    """Positions of stage 1's items in the final order. `scores`: item -> the ranker's per-task probabilities, for
    the items it ranked (the others follow the ranked ones, in stage 1's order)."""

    def key(position: int) -> tuple[bool, float, int]:
        found = scores.get(item_ids[position])
        return (found is None, -found[task] if found is not None else 0.0, position)

    return sorted(range(len(item_ids)), key=key)
