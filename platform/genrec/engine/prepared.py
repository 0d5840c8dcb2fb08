"""A request checked against the model and turned into tensors, before any model compute.

Everything a client can get wrong is caught here (InvalidRequestError naming the field), so a batch or
an engine loop never starts work it cannot finish.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from genrec.api import Candidate, RecommendRequest, RetrieveRequest, ScoreRequest
from genrec.engine.candidates import candidate_token_lists, label_token_ids
from genrec.engine.prompts import prompt_token_ids
from genrec.engine.soft_token import check_user_embedding
from genrec.errors import InvalidRequestError

# The request class of each kind, the most specific first (a RecommendRequest is also a RetrieveRequest).
KINDS = {"recommend": RecommendRequest, "retrieve": RetrieveRequest, "score": ScoreRequest}


def request_kind(request) -> str | None:
    return next((kind for kind, cls in KINDS.items() if isinstance(request, cls)), None)


def check_kind(request, kind: str) -> None:
    """The entry for `kind` takes exactly that kind: retrieve refuses a RecommendRequest, too."""
    if request_kind(request) != kind:
        raise InvalidRequestError("request", f"expected {KINDS[kind].__name__}, got {type(request).__name__}")


@dataclass
class Prepared:
    request: RetrieveRequest | ScoreRequest | RecommendRequest
    token_ids: torch.Tensor  # [T] int64, on the host
    candidate_tokens: list[list[int]] | None = None  # the given candidates' token lists (score, recommend)
    given: list[Candidate] | None = None  # the candidates those lists are of (recommend: after exclusions)
    labels: tuple[int, int] | None = None
    exclusions: list[int] | None = None  # catalog indices (retrieve, recommend)
    unknown_exclusions: int = 0

    @property
    def kind(self) -> str:
        return request_kind(self.request)

    @property
    def uses_beams(self) -> bool:
        return self.kind in ("retrieve", "recommend")


def prepare(engine, req) -> Prepared:
    if request_kind(req) is None:
        expected = ", ".join(cls.__name__ for cls in KINDS.values())
        raise InvalidRequestError("request", f"expected one of {expected}, got {type(req).__name__}")
    token_ids = prompt_token_ids(req, engine.tokenizer, engine.model.config.vocab_size, engine.max_prompt_tokens)
    check_user_embedding(token_ids, engine.placeholder_id, req.user_embedding, engine.projector)
    prepared = Prepared(req, token_ids)
    if isinstance(req, RetrieveRequest):
        known = [i for i in map(engine.catalog.index_of, req.exclude_item_ids) if i is not None]
        prepared.exclusions = sorted(set(known))
        prepared.unknown_exclusions = len(req.exclude_item_ids) - len(known)
    if isinstance(req, ScoreRequest | RecommendRequest):
        tokens = candidate_token_lists(engine, req.candidates, len(token_ids))  # every candidate validated
        keep = _kept(engine, req.candidates, prepared.exclusions) if prepared.kind == "recommend" else None
        prepared.given = req.candidates if keep is None else [req.candidates[k] for k in keep]
        prepared.candidate_tokens = tokens if keep is None else [tokens[k] for k in keep]
        prepared.labels = label_token_ids(engine.tokenizer, req.labels)
    return prepared


def _kept(engine, candidates: list[Candidate], exclusions: list[int]) -> list[int]:
    """Recommend: the given candidates to rank, in order: no excluded item, each item once."""
    skip, keep = set(exclusions), []
    for k, cand in enumerate(candidates):
        if cand.item_id is not None:
            index = engine.catalog.index_of(cand.item_id)
            if index in skip:
                continue
            skip.add(index)
        keep.append(k)
    return keep
