"""Rank every user's held-out item with the models and with the most-popular baseline, on unseen items only.

The models' rankings come from the batch job's output rows. Recommend rows: each user's items by score are
recommend's order; the same items by beam-search log-probability are retrieve's order. Two-stage rows (with a
`retrieval_rank` column, stage 1's order): `rank` is the HSTU ranker's order ("ranker"), stage 1's is
recommend's, and the beam log-probability gives retrieve's again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from genrec_demo.data import MovieLens
from genrec_demo.metrics import hit_ranks, mrr, ndcg_at, paired, popularity_rankings, recall_at

METHODS = ("retrieve", "recommend", "ranker", "popularity")


@dataclass
class Evaluation:
    ranks: dict[str, np.ndarray]  # method -> [users] 0-based rank of the held-out item (depth: a miss)
    depth: int

    def table(self, k: int = 10) -> dict[str, dict[str, float]]:
        """Recall@k and NDCG@k, and the MRR over the whole depth, per method."""
        return {
            m: {f"recall@{k}": recall_at(r, k), f"ndcg@{k}": ndcg_at(r, k), f"mrr@{self.depth}": mrr(r, self.depth)}
            for m, r in self.ranks.items()
        }

    def paired(self, method: str, baseline: str, k: int = 10) -> dict[str, float | int]:
        """`method` against `baseline` user by user (see metrics.paired)."""
        return paired(self.ranks[method], self.ranks[baseline], k)

    def recall_curve(self, method: str) -> np.ndarray:
        """Recall@K for K = 1..depth."""
        return np.array([recall_at(self.ranks[method], k) for k in range(1, self.depth + 1)])


def retrieve_order(items: list[str], retrieval_logprobs: list[float | None]) -> list[str]:
    """The retrieved items (a given candidate has no beam log-probability) by beam-search log-probability,
    best first: what Engine.retrieve returns."""
    retrieved = [i for i, logprob in enumerate(retrieval_logprobs) if logprob is not None]
    return [items[i] for i in sorted(retrieved, key=lambda i: -retrieval_logprobs[i])]


def rankings_from_rows(rows: pa.Table, data: MovieLens, depth: int) -> dict[str, np.ndarray]:
    """Output rows (user_id, rank, item_id, retrieval_logprob, and retrieval_rank when two-stage) ->
    {"retrieve", "recommend"(, "ranker")}: [users, depth] item indices, -1 where a user has fewer (or no) rows."""
    two_stage = "retrieval_rank" in rows.column_names
    rows = rows.sort_by([("user_id", "ascending"), ("rank", "ascending")])
    users, items, logprobs = (rows.column(c).to_pylist() for c in ("user_id", "item_id", "retrieval_logprob"))
    stage1 = rows.column("retrieval_rank").to_pylist() if two_stage else None
    user_index = {u: i for i, u in enumerate(data.user_ids)}
    item_index = {item: i for i, item in enumerate(data.item_ids)}
    kinds = METHODS[:3] if two_stage else METHODS[:2]
    out = {kind: np.full((len(data.user_ids), depth), -1, dtype=np.int64) for kind in kinds}
    bounds = [0, *(i for i in range(1, len(users)) if users[i] != users[i - 1]), len(users)]
    for start, stop in zip(bounds[:-1], bounds[1:], strict=False):
        if start == stop:
            continue
        u, ranked = user_index[str(users[start])], items[start:stop]
        orders = {"retrieve": retrieve_order(ranked, logprobs[start:stop])}
        if two_stage:
            orders |= {
                "ranker": ranked,
                "recommend": [ranked[i] for i in np.argsort(stage1[start:stop], kind="stable")],
            }
        else:
            orders["recommend"] = ranked
        for kind, order in orders.items():
            order = order[:depth]
            out[kind][u, : len(order)] = [item_index[i] for i in order]
    return out


def measure(rankings: dict[str, np.ndarray], data: MovieLens, depth: int) -> Evaluation:
    """The engine's rankings plus most-popular, each scored on every user's held-out (test) item."""
    targets = np.array([data.test(u) for u in range(len(data.user_ids))])
    seen = [data.seen_before_test(u) for u in range(len(data.user_ids))]
    rankings = {**rankings, "popularity": popularity_rankings(data.popularity, seen, depth)}
    return Evaluation({m: hit_ranks(r, targets) for m, r in rankings.items()}, depth)
