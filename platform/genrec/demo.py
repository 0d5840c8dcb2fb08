"""The demo: build a tiny model locally, load it through the user-facing path, then retrieve, score and
recommend (with a soft-token user embedding) on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from genrec.api import Candidate, RecommendRequest, RetrieveRequest, ScoreRequest
from genrec.engine import Engine
from genrec.model.tiny import ModelSpec, write_model_dir

PROMPT = "user <|user|> listened to comedy podcast episode then news daily"


def run_demo(model_dir: Path) -> dict:
    if not (model_dir / "genrec" / "catalog.parquet").exists():
        write_model_dir(model_dir, ModelSpec(items=1000, levels=3, codebook=16))
    engine = Engine.from_pretrained(model_dir)
    user = np.random.default_rng(7).normal(size=engine.projector.user_dim).round(4).tolist()
    (retrieved,) = engine.retrieve([RetrieveRequest(prompt=PROMPT, user_embedding=user, beam_width=32, num_results=5)])
    candidates = [Candidate(item_id=i.item_id) for i in retrieved.items[:3]] + [Candidate(text="a science show")]
    (scored,) = engine.score([ScoreRequest(prompt=PROMPT, user_embedding=user, candidates=candidates)])
    (recommended,) = engine.recommend(
        [RecommendRequest(prompt=PROMPT, user_embedding=user, beam_width=32, num_results=5, candidates=candidates[3:])]
    )
    return {
        "model_dir": str(model_dir),
        "catalog_items": len(engine.catalog),
        "retrieve (beam search, all beams)": [f"{i.item_id} logprob={i.logprob:.3f}" for i in retrieved.items],
        "score (one pass)": [
            f"{c.item_id or 'text'} logprob(yes)={c.logprob:.3f} P(yes)={c.prob:.3f}" for c in scored.scores
        ],
        "recommend (retrieve then rank, one prefill)": [
            f"{i.item_id or 'text'} [{i.source}] logprob(yes)={i.score_logprob:.3f}" for i in recommended.items
        ],
    }
