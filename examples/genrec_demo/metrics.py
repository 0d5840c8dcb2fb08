"""Leave-last-out ranking metrics (one held-out item per user) and the most-popular baseline."""

from __future__ import annotations

import numpy as np


def hit_ranks(rankings: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """0-based rank of each row's target in its ranking [users, K] (item indices, -1 pads); K where absent."""
    hits = rankings == targets[:, None]
    return np.where(hits.any(axis=1), hits.argmax(axis=1), rankings.shape[1])


def recall_at(ranks: np.ndarray, k: int) -> float:
    """Share of users whose held-out item is in the top k (with one relevant item, recall = hit rate)."""
    return float(np.mean(ranks < k))


def ndcg_at(ranks: np.ndarray, k: int) -> float:
    """Mean of 1 / log2(rank + 2) over users whose item is in the top k (the ideal DCG of one item is 1)."""
    return float(np.mean(ndcg_gains(ranks, k)))


def mrr(ranks: np.ndarray, depth: int) -> float:
    """Mean reciprocal rank within the ranking's depth (a miss counts 0): how high the item sits, all K at once."""
    return float(np.mean(np.where(ranks < depth, 1.0 / (ranks + 1.0), 0.0)))


def popularity_rankings(popularity: np.ndarray, seen: list[np.ndarray], k: int) -> np.ndarray:
    """Per user, the k most popular items they have not seen (ties: lower item index first)."""
    order = np.argsort(-popularity, kind="stable")
    out = np.full((len(seen), k), -1, dtype=np.int64)
    for u, items in enumerate(seen):
        unseen = order[~np.isin(order, items)][:k]
        out[u, : len(unseen)] = unseen
    return out


def ndcg_gains(ranks: np.ndarray, k: int) -> np.ndarray:
    """Each user's NDCG@k: 1 / log2(rank + 2) when the item is in the top k, else 0 (ndcg_at is their mean)."""
    return np.where(ranks < k, 1.0 / np.log2(np.minimum(ranks, k) + 2.0), 0.0)


def paired(ranks: np.ndarray, baseline: np.ndarray, k: int) -> dict[str, float | int]:
    """One order against another on the same users: the mean per-user NDCG@k difference and its standard error,
    and how many users gain the held-out item in the top k (absent from the baseline's) or lose it."""
    diff = ndcg_gains(ranks, k) - ndcg_gains(baseline, k)
    se = float(diff.std(ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else float("nan")
    hit, base_hit = ranks < k, baseline < k
    return {
        f"ndcg@{k} difference": round(float(diff.mean()), 4),
        "standard error": round(se, 4),
        "users gained": int((hit & ~base_hit).sum()),
        "users lost": int((~hit & base_hit).sum()),
    }
