"""Rank retrieved items with the served HSTU (genrec's Engine, batched requests), and compare orders."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from genrec.api import Event, RankRequest
from genrec.engine import Engine
from genrec_demo.metrics import ndcg_at, recall_at
from genrec_demo.train import one_thread

BATCH = 64  # requests per engine call
TASK = "watch"  # the order: the probability the user watches the item next


def rank_retrieved(
    ranker, histories: list[list[dict]], retrieved: list[list[str]], task: str = TASK, batch: int = BATCH
) -> list[list[str]]:
    """Each user's retrieved item IDs reordered by the ranker's `task` probability, best first.

    ranker: an Engine of the HSTU ranker, or its directory. histories: per user, the events before the target
    (`MovieLens.events`, oldest first). A user with no retrieved items keeps an empty list."""
    engine = ranker if isinstance(ranker, Engine) else Engine.from_pretrained(Path(ranker))
    users = [u for u, items in enumerate(retrieved) if items]
    out: list[list[str]] = [[] for _ in retrieved]
    with one_thread():
        for start in range(0, len(users), batch):
            part = users[start : start + batch]
            requests = [_request(histories[u], retrieved[u], task) for u in part]
            for u, result in zip(part, engine.rank(requests), strict=True):
                scores = np.array([item.scores[task] for item in result.items])
                out[u] = [retrieved[u][i] for i in np.argsort(-scores, kind="stable")]
    return out


def _request(history: list[dict], candidates: list[str], task: str) -> RankRequest:
    return RankRequest(history=[Event(**e) for e in history], candidates=candidates, tasks=[task])


def quality(orders: list[list[str]], targets: list[str], k: int = 10) -> dict[str, float]:
    """Recall@k and NDCG@k of each user's target in their ordered items (a miss: absent from the list)."""
    ranks = np.array(
        [order.index(t) if t in order else len(order) + k for order, t in zip(orders, targets, strict=True)]
    )
    return {f"recall@{k}": round(recall_at(ranks, k), 4), f"ndcg@{k}": round(ndcg_at(ranks, k), 4)}
