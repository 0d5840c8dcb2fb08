"""Rank every user's held-out item with the engine and with the most-popular baseline, on unseen items only.

One recommend per user gives both engine orders: its beams by beam-search logprob (what retrieve returns)
and by score (what recommend returns).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from genrec.api import RecommendRequest, RecommendResult
from genrec.demo.data import MovieLens
from genrec.demo.metrics import hit_ranks, ndcg_at, popularity_rankings, recall_at
from genrec.demo.prompts import prompt_text, prompt_token_ids
from genrec.engine import Engine
from genrec.model.tokenizer import USER_TOKEN

METHODS = ("retrieve", "recommend", "popularity")


@dataclass
class Evaluation:
    ranks: dict[str, np.ndarray]  # method -> [users] 0-based rank of the held-out item (depth: a miss)
    depth: int

    def table(self, k: int = 10) -> dict[str, dict[str, float]]:
        return {m: {f"recall@{k}": recall_at(r, k), f"ndcg@{k}": ndcg_at(r, k)} for m, r in self.ranks.items()}

    def recall_curve(self, method: str) -> np.ndarray:
        """Recall@K for K = 1..depth."""
        return np.array([recall_at(self.ranks[method], k) for k in range(1, self.depth + 1)])


def user_request(engine: Engine, data: MovieLens, user_vectors, u: int, history: int, beam: int):
    """User u's recommend request for their next item: the history before the test item, all of it excluded."""
    seen = data.seen_before_test(u)
    codes = engine.catalog.codes
    prompt = prompt_text(engine.tokenizer, prompt_token_ids(codes, seen, engine.placeholder_id, history))
    return RecommendRequest(
        prompt=prompt,
        user_embedding=user_vectors[u].tolist(),
        beam_width=beam,
        num_results=beam,
        exclude_item_ids=[data.item_ids[i] for i in seen],
        request_id=data.user_ids[u],
    )


def two_orders(result: RecommendResult) -> tuple[list[str], list[str]]:
    """(retrieve, recommend) orders of one recommend result: the beams by their beam-search logprob, as
    Engine.retrieve returns them, and by score (the order recommend returns)."""
    retrieved = sorted(result.items, key=lambda item: -item.retrieval_logprob)
    return [i.item_id for i in retrieved], [i.item_id for i in result.items]


def engine_rankings(engine, data, user_vectors, history, beam, chunk=64, progress=True) -> dict[str, np.ndarray]:
    """{"retrieve", "recommend"}: [users, beam] item indices (-1 where fewer came back), from one beam search."""
    index = {item: i for i, item in enumerate(data.item_ids)}
    out = {kind: np.full((len(data.user_ids), beam), -1, dtype=np.int64) for kind in METHODS[:2]}
    for start in tqdm(range(0, len(data.user_ids), chunk), desc="recommend", disable=not progress):
        users = range(start, min(start + chunk, len(data.user_ids)))
        results = engine.recommend([user_request(engine, data, user_vectors, u, history, beam) for u in users])
        for u, result in zip(users, results, strict=True):
            for kind, items in zip(METHODS[:2], two_orders(result), strict=True):
                out[kind][u, : len(items)] = [index[i] for i in items]
    return out


def evaluate(engine, data: MovieLens, user_vectors, history: int, beam: int = 50, progress=True) -> Evaluation:
    if engine.placeholder_id is None:
        raise ValueError(f"the model's tokenizer has no {USER_TOKEN} token")
    targets = np.array([data.test(u) for u in range(len(data.user_ids))])
    seen = [data.seen_before_test(u) for u in range(len(data.user_ids))]
    rankings = engine_rankings(engine, data, user_vectors, history, beam, progress=progress)
    rankings["popularity"] = popularity_rankings(data.popularity, seen, beam)
    return Evaluation({m: hit_ranks(r, targets) for m, r in rankings.items()}, beam)
