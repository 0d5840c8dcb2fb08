"""A request checked against the model and turned into tensors, before any model compute.

Everything a client can get wrong is caught here (InvalidRequestError naming the field), so a batch or
an engine loop never starts work it cannot finish.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from genrec.api import Candidate, RankRequest, RecommendRequest, RetrieveRequest, ScoreRequest
from genrec.engine.candidates import candidate_token_lists, label_token_ids
from genrec.engine.prompts import prompt_token_ids
from genrec.engine.soft_token import check_user_embedding
from genrec.errors import InvalidRequestError

# The request class of each kind, the most specific first (a RecommendRequest is also a RetrieveRequest).
KINDS = {"recommend": RecommendRequest, "retrieve": RetrieveRequest, "score": ScoreRequest, "rank": RankRequest}
# The kinds each model family serves.
FAMILY_KINDS = {"qwen3": ("retrieve", "score", "recommend"), "hstu": ("rank",)}


def request_kind(request) -> str | None:
    return next((kind for kind, cls in KINDS.items() if isinstance(request, cls)), None)


def check_kind(request, kind: str) -> None:
    """The entry for `kind` takes exactly that kind: retrieve refuses a RecommendRequest, too."""
    if request_kind(request) != kind:
        raise InvalidRequestError("request", f"expected {KINDS[kind].__name__}, got {type(request).__name__}")


@dataclass
class Prepared:
    request: RetrieveRequest | ScoreRequest | RecommendRequest | RankRequest
    # The context, on the host: a prompt's token IDs [T] int64; a rank request's events [T, 3] int64 (embedding
    # row of the item, action, time bucket). Its rows are what the prefix cache keys.
    token_ids: torch.Tensor
    candidate_tokens: list[list[int]] | None = None  # the given candidates' token lists (score, recommend)
    given: list[Candidate] | None = None  # the candidates those lists are of (recommend: after exclusions)
    labels: tuple[int, int] | None = None
    exclusions: list[int] | None = None  # catalog indices (retrieve, recommend)
    unknown_exclusions: int = 0
    candidate_rows: np.ndarray | None = None  # rank: the candidates' embedding rows
    tasks: list[int] | None = None  # rank: the model's task indices to return, in order

    @property
    def kind(self) -> str:
        return request_kind(self.request)

    @property
    def uses_beams(self) -> bool:
        return self.kind in ("retrieve", "recommend")


def prepare(engine, req) -> Prepared:
    kind = request_kind(req)
    if kind is None:
        expected = ", ".join(cls.__name__ for cls in KINDS.values())
        raise InvalidRequestError("request", f"expected one of {expected}, got {type(req).__name__}")
    if kind not in FAMILY_KINDS[engine.family]:
        served = " and ".join(FAMILY_KINDS[engine.family])
        raise InvalidRequestError("request", f"this engine's model ({engine.family}) serves {served}, not {kind}")
    if kind == "rank":
        return prepare_rank(engine, req)
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


def prepare_rank(engine, req: RankRequest) -> Prepared:
    """The history as event rows (item row, action, time bucket) and the candidates' rows, each checked."""
    config, items = engine.model.config, engine.catalog
    if len(req.history) > config.max_history_events:
        raise InvalidRequestError(
            "history", f"{len(req.history)} events exceed this model's limit of {config.max_history_events}"
        )
    if len(req.candidates) > engine.max_candidates:
        raise InvalidRequestError(
            "candidates", f"{len(req.candidates)} candidates exceed this engine's limit of {engine.max_candidates}"
        )
    rows = []
    for i, event in enumerate(req.history):
        row = items.row_of(event.item_id)
        if row is None:
            raise InvalidRequestError(f"history[{i}].item_id", f"unknown item {event.item_id!r}")
        if event.action is not None and event.action >= config.num_actions:
            raise InvalidRequestError(
                f"history[{i}].action", f"{event.action} is not an action of this model (0..{config.num_actions - 1})"
            )
        rows.append(row)
    actions = [config.no_action if e.action is None else e.action for e in req.history]
    if config.num_time_buckets:
        buckets = config.time_buckets([e.timestamp for e in req.history])
    else:
        buckets = [0] * len(req.history)
    candidate_rows = []
    for i, item in enumerate(req.candidates):
        row = items.row_of(item)
        if row is None:
            raise InvalidRequestError(f"candidates[{i}]", f"unknown item {item!r}")
        candidate_rows.append(row)
    tasks = list(range(len(config.tasks)))
    if req.tasks is not None:
        unknown = [(i, t) for i, t in enumerate(req.tasks) if t not in config.tasks]
        if unknown:
            i, task = unknown[0]
            raise InvalidRequestError(f"tasks[{i}]", f"{task!r} is not a task of this model {list(config.tasks)}")
        tasks = [config.tasks.index(t) for t in req.tasks]
    events = torch.tensor(np.stack([rows, actions, buckets], axis=1), dtype=torch.int64)
    return Prepared(req, events, candidate_rows=np.asarray(candidate_rows, dtype=np.int64), tasks=tasks)
