"""Choose how recommend ranks, on the validation split (each user's second-to-last item), never the test item.

recommend ranks the retrieved items by code_logprob + w * score_logprob (rank_by="joint"). The yes/no label
is trained beside the generator in a few CPU minutes; how far its opinion should move the generator's order
is measured here on held-out validation items, with the same Engine the platform serves (in process: it is a
step of building the model, like training).

The weights tried stop at 0.25. Measured on seven trained models: the label alone ranks well below the
generator on the test items (Recall@10 0.13-0.16 against 0.18-0.20), and validation items flatter it: there
it is 0.03-0.04 below the generator, and weights of 0.5-1 often look best, which lose up to 0.015 on the test
items. At 0.25 it only reorders the generator's near-ties: Recall@10 -0.004 to +0.008 on the test items
(mean +0.002), NDCG@10 up on every one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from genrec.api import RecommendedItem, RecommendRequest
from genrec.engine import Engine
from genrec_demo.data import MovieLens
from genrec_demo.metrics import ndcg_at, recall_at
from genrec_demo.pipeline.inputs import Prompts
from genrec_demo.train import one_thread

WEIGHTS = (0.0, 0.1, 0.25)  # 0 keeps the generator's order
K = 10
BATCH = 64  # users per engine call


def choose_ranking(model_dir: Path, data: MovieLens, user_vectors: np.ndarray, history: int, beam: int) -> dict:
    """{"rank_by": "joint", "score_weight": w, "validation recall@10": {w: Recall@10}, "beam", "weights"}: the
    best w on the validation items (ties: better NDCG@10, then the smaller weight)."""
    items = _validation_recommendations(model_dir, data, user_vectors, history, beam)
    measured = measure_weights(items, [data.item_ids[data.valid(u)] for u in range(len(data.user_ids))])
    validation = {str(w): round(recall, 4) for w, (recall, _) in measured.items()}
    chosen = {"rank_by": "joint", "score_weight": best_weight(measured), f"validation recall@{K}": validation}
    return chosen | {"beam": beam, "weights": list(WEIGHTS)}


def is_current(ranking: dict | None, beam: int) -> bool:
    """Whether a kept ranking was chosen for this beam among today's weights."""
    return ranking is not None and ranking.get("beam") == beam and ranking.get("weights") == list(WEIGHTS)


def best_weight(measured: dict[float, tuple[float, float]]) -> float:
    """The weight of best recall, then best NDCG, then the smallest (the generator's order is the default)."""
    return max(measured, key=lambda w: (*measured[w], -w))


def measure_weights(
    items: list[list[RecommendedItem]], targets: list[str], weights=WEIGHTS
) -> dict[float, tuple[float, float]]:
    """{w: (Recall@K, NDCG@K)} of each user's target among their items ranked by code + w * score logprob."""
    out = {}
    for weight in weights:
        ranks = np.array([_rank_of(target, ranked, weight) for ranked, target in zip(items, targets, strict=True)])
        out[weight] = (recall_at(ranks, K), ndcg_at(ranks, K))
    return out


def _rank_of(target: str, items: list[RecommendedItem], weight: float) -> int:
    """0-based rank of `target` among `items` by code + weight * score logprob; len(items) when absent."""
    order = sorted(items, key=lambda i: -(i.code_logprob + weight * i.score_logprob))
    return next((k for k, item in enumerate(order) if item.item_id == target), len(items))


def _validation_recommendations(model_dir, data: MovieLens, user_vectors, history: int, beam: int) -> list[list]:
    """Per user: the retrieved items for their validation item (prompt: the training items, all excluded)."""
    engine = Engine.from_pretrained(model_dir)
    prompts = Prompts.of(model_dir, data, history)
    out = []
    with one_thread():
        for start in range(0, len(data.user_ids), BATCH):
            users = range(start, min(start + BATCH, len(data.user_ids)))
            requests = [_request(data, prompts, user_vectors, u, beam) for u in users]
            out += [result.items for result in engine.recommend(requests)]
    return out


def _request(data: MovieLens, prompts: Prompts, user_vectors, u: int, beam: int) -> RecommendRequest:
    seen = data.train(u)
    return RecommendRequest(
        prompt=prompts.text(seen),
        user_embedding=user_vectors[u].tolist(),
        beam_width=beam,
        num_results=beam,
        exclude_item_ids=[data.item_ids[i] for i in seen],
        rank_by="joint",
    )
