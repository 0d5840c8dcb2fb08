"""A request checked against the model and turned into tensors, before any model compute.

Everything a client can get wrong is caught here (InvalidRequestError naming the field), so a batch or
an engine loop never starts work it cannot finish.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from genrec.api import RecommendRequest, RetrieveRequest, ScoreRequest
from genrec.engine.candidates import candidate_token_lists, label_token_ids
from genrec.engine.prompts import prompt_token_ids
from genrec.engine.soft_token import check_user_embedding


@dataclass
class Prepared:
    request: RetrieveRequest | ScoreRequest | RecommendRequest
    token_ids: torch.Tensor  # [T] int64, on the host
    candidates: list[list[int]] | None = None  # given candidates' tokens (score, recommend)
    labels: tuple[int, int] | None = None
    exclusions: list[int] | None = None  # catalog indices (retrieve, recommend)
    unknown_exclusions: int = 0

    @property
    def kind(self) -> str:
        if isinstance(self.request, RecommendRequest):
            return "recommend"
        return "retrieve" if isinstance(self.request, RetrieveRequest) else "score"

    @property
    def beams(self) -> bool:
        return self.kind in ("retrieve", "recommend")


def prepare(engine, req) -> Prepared:
    token_ids = prompt_token_ids(req, engine.tokenizer, engine.model.config.vocab_size, engine.max_prompt_tokens)
    check_user_embedding(token_ids, engine.placeholder_id, req.user_embedding, engine.projector)
    prepared = Prepared(req, token_ids)
    if isinstance(req, ScoreRequest | RecommendRequest):
        prepared.candidates = candidate_token_lists(engine, req.candidates, len(token_ids))
        prepared.labels = label_token_ids(engine.tokenizer, req.labels)
    if isinstance(req, RetrieveRequest):
        known = [i for i in map(engine.catalog.index_of, req.exclude_item_ids) if i is not None]
        prepared.exclusions = sorted(set(known))
        prepared.unknown_exclusions = len(req.exclude_item_ids) - len(known)
    return prepared
