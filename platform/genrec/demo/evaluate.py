"""Rank every user's held-out item with the engine (retrieve; recommend = retrieve then rank by score)
and with the most-popular baseline, on unseen items only."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from genrec.api import RecommendRequest, RetrieveRequest
from genrec.demo.data import MovieLens
from genrec.demo.metrics import hit_ranks, ndcg_at, popularity_rankings, recall_at
from genrec.demo.prompts import prompt_text, prompt_token_ids
from genrec.engine import Engine
from genrec.model.tokenizer import USER_TOKEN

KINDS = {"retrieve": RetrieveRequest, "recommend": RecommendRequest}


@dataclass
class Evaluation:
    ranks: dict[str, np.ndarray]  # method -> [users] 0-based rank of the held-out item (depth: a miss)
    depth: int

    def table(self, k: int = 10) -> dict[str, dict[str, float]]:
        return {m: {f"recall@{k}": recall_at(r, k), f"ndcg@{k}": ndcg_at(r, k)} for m, r in self.ranks.items()}

    def recall_curve(self, method: str) -> np.ndarray:
        """Recall@K for K = 1..depth."""
        return np.array([recall_at(self.ranks[method], k) for k in range(1, self.depth + 1)])


def user_request(kind: str, engine: Engine, data: MovieLens, user_vectors, u: int, history: int, beam: int):
    """The request for user u's next item: their history before the test item, all of it excluded."""
    seen = data.seen_before_test(u)
    codes = engine.catalog.codes
    prompt = prompt_text(engine.tokenizer, prompt_token_ids(codes, seen, engine.placeholder_id, history))
    return KINDS[kind](
        prompt=prompt,
        user_embedding=user_vectors[u].tolist(),
        beam_width=beam,
        num_results=beam,
        exclude_item_ids=[data.item_ids[i] for i in seen],
        request_id=data.user_ids[u],
    )


def engine_rankings(kind, engine, data, user_vectors, history, beam, chunk=64, progress=True) -> np.ndarray:
    """[users, beam] item indices in the engine's order (-1 where fewer came back)."""
    index = {item: i for i, item in enumerate(data.item_ids)}
    out = np.full((len(data.user_ids), beam), -1, dtype=np.int64)
    run = engine.retrieve if kind == "retrieve" else engine.recommend
    for start in tqdm(range(0, len(data.user_ids), chunk), desc=kind, disable=not progress):
        users = range(start, min(start + chunk, len(data.user_ids)))
        results = run([user_request(kind, engine, data, user_vectors, u, history, beam) for u in users])
        for u, result in zip(users, results, strict=True):
            ranked = [index[item.item_id] for item in result.items]
            out[u, : len(ranked)] = ranked
    return out


def evaluate(engine, data: MovieLens, user_vectors, history: int, beam: int = 50, progress=True) -> Evaluation:
    if engine.placeholder_id is None:
        raise ValueError(f"the model's tokenizer has no {USER_TOKEN} token")
    targets = np.array([data.test(u) for u in range(len(data.user_ids))])
    seen = [data.seen_before_test(u) for u in range(len(data.user_ids))]
    rankings = {
        kind: engine_rankings(kind, engine, data, user_vectors, history, beam, progress=progress) for kind in KINDS
    }
    rankings["popularity"] = popularity_rankings(data.popularity, seen, beam)
    return Evaluation({m: hit_ranks(r, targets) for m, r in rankings.items()}, beam)
