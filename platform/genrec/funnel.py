"""The retrieve -> rank funnel's policy, once for the online app and the nightly job (no Ray, no I/O here).

Stage 1 (the Qwen3 retriever's recommend in beam order, rank_by 'beam') finds a user's items: its beams, then the
given items the decoder's one rule keeps (genrec.engine.retriever `_kept`). Stage 2 (the HSTU ranker) ranks them
after the user's history. The two models' catalogs may differ: the ranker skips the items it does not know
(RankRequest.unknown_candidates 'skip', applied in the ranker after it checked the history; none known: nothing
ranked, no error). The final order is `final_order`: the ranked items by the rank task's probability, highest
first, ties in stage 1's order; then the items the ranker did not rank, in stage 1's order.
"""

from __future__ import annotations

from collections.abc import Sequence


def final_order(item_ids: Sequence[str], scores: dict[str, dict[str, float]], task: str) -> list[int]:
    """Positions of stage 1's items in the final order; `scores`: item -> per-task probabilities, ranked items only."""

    def key(position: int) -> tuple[bool, float, int]:
        found = scores.get(item_ids[position])
        return (found is None, -found[task] if found is not None else 0.0, position)

    return sorted(range(len(item_ids)), key=key)
