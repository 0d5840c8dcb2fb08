"""The two-stage recommend (an app with a ranker, a body with `history`): what each stage is sent, and the merge.

Stage 1, the retrieval model's beam search (retrieve) with every beam returned; stage 2, the ranker's rank of
those items, then of the given item_id candidates that were not retrieved, after the user's history; the answer,
those items ordered by the ranker's probability for `rank_task` (ties in stage-1 order, given ones after the
retrieved), each with the ranker's per-task probabilities. Items the ranker could not rank (not in its catalog:
the two models' catalogs may differ) follow the ranked ones, in that order, with `ranker_scores` None.

The ranker, not a label, orders the items: stage 1 scores no label (score_logprob and prob are None), and the
label's fields (labels, rank_by, score_weight) are refused. Candidates given as text or token IDs have no item
the ranker knows: refused too.

One deadline for both: stage 1 is given the deadline less a reserve kept for stage 2 (`stage1_timeout`), stage 2
what is left. When stage 2 fails (the ranker unavailable, overloaded, out of time, or failing), the answer is
stage 1's items in beam order, the given ones after, marked `degraded` with the reason (`degraded_reason`), unless
the ingress is set to fail instead; a client's mistake the ranker finds stays the client's 4xx.

No Ray here: the ingress makes the calls (ingress.py), under one deadline.
"""

from __future__ import annotations

from genrec.api import (
    RankRequest,
    RankResult,
    RecommendedItem,
    RecommendRequest,
    RecommendResult,
    RetrieveRequest,
    RetrieveResult,
)
from genrec.errors import EngineStopped, InvalidRequestError, Overloaded, RequestTimeout
from genrec.funnel import final_order, known
from genrec.serving.http_errors import EngineUnavailable, is_client_error
from genrec.serving.schemas import RankerFacts, RecommendBody

LABEL_FIELDS = ("labels", "rank_by", "score_weight")  # recommend's label ranking: not a two-stage request's
# Why a two-stage recommend answered with its retrieval alone: the first type the ranking's error is an instance of.
DEGRADED_REASONS = (
    (Overloaded, "ranker_overloaded"),
    (RequestTimeout, "ranker_timeout"),
    ((EngineUnavailable, EngineStopped), "ranker_unavailable"),
)
REASONS = (*(reason for _, reason in DEGRADED_REASONS), "ranker_error")  # ranker_error: anything else (a bug)


def check_form(body: RecommendBody) -> None:
    """What no ranker takes, whatever its limits: the label's fields, candidates that are not catalog items."""
    for name in LABEL_FIELDS:
        if name in body.model_fields_set:
            raise InvalidRequestError(name, "a two-stage recommend (with history) is ranked by the ranker: omit it")
    for i, candidate in enumerate(body.candidates):
        for form in ("text", "token_ids"):
            if getattr(candidate, form) is not None:
                raise InvalidRequestError(
                    f"candidates[{i}].{form}",
                    "a two-stage recommend (with history) ranks catalog items only: give candidates as item_id",
                )


def check_body(body: RecommendBody, ranker: RankerFacts) -> str:
    """What the ranker would refuse, refused before stage 1 runs (before stage 2 when the ranker's facts must be
    asked of it); returns the task the items are ordered by."""
    check_form(body)
    if len(body.history) > ranker.max_history_events:
        raise InvalidRequestError(
            "history", f"{len(body.history)} events exceed the ranker's limit of {ranker.max_history_events}"
        )
    ranked = body.beam_width + len(body.candidates)  # at most: a given item may also be retrieved
    if ranked > ranker.max_candidates:
        raise InvalidRequestError(
            "beam_width",
            f"beam_width + candidates ({ranked}) exceed the ranker's limit of {ranker.max_candidates} items",
        )
    if body.rank_task is None:
        return ranker.tasks[0]
    if body.rank_task not in ranker.tasks:
        raise InvalidRequestError("rank_task", f"{body.rank_task!r} is not a task of the ranker {ranker.tasks}")
    return body.rank_task


def stage1_timeout(timeout_s: float, reserve_s: float) -> float:
    """Of a request's `timeout_s`, the seconds stage 1 is given: all but the reserve, and at least half."""
    return timeout_s - min(reserve_s, timeout_s / 2)


def degraded_reason(error: BaseException) -> str | None:
    """Why stage 2 failed, as a degraded answer says it; None: the client's mistake (its 4xx stands)."""
    if is_client_error(error):
        return None
    return next((reason for types, reason in DEGRADED_REASONS if isinstance(error, types)), "ranker_error")


def stage1(request: RecommendRequest) -> RetrieveRequest:
    """The retrieval request with every beam kept: the ranker, not the beam order, decides which are returned."""
    fields = request.model_dump(include=set(RetrieveRequest.model_fields))
    return RetrieveRequest.model_validate(fields | {"num_results": request.beam_width})


def candidates(
    request: RecommendRequest, retrieved: RetrieveResult, filtered: list[str] | None = None
) -> list[RecommendedItem]:
    """What the ranker ranks, in stage-1 order: the retrieved items (stage 1 honoured the request's filters), then
    the given item_ids neither retrieved nor excluded nor outside `allowed_item_ids` nor, with attribute `filters`,
    outside `filtered` (the given items the retriever's catalog allows: `needs_filtering`), each once, with their
    stage-1 fields."""
    given = {c.item_id for c in request.candidates} - set(request.exclude_item_ids)
    if request.allowed_item_ids is not None:
        given &= set(request.allowed_item_ids)
    if filtered is not None:
        given &= set(filtered)
    items = [RecommendedItem.retrieved(r, given) for r in retrieved.items]
    seen = {r.item_id for r in retrieved.items}
    for c in request.candidates:
        if c.item_id in given and c.item_id not in seen:
            seen.add(c.item_id)
            items.append(RecommendedItem(item_id=c.item_id, source="given"))
    return items


def needs_filtering(request: RecommendRequest) -> bool:
    """Whether the given candidates must be checked against attribute filters by the retriever's catalog."""
    return request.filters is not None and any(c.item_id is not None for c in request.candidates)


def stage2(body: RecommendBody, items: list[RecommendedItem]) -> RankRequest | None:
    """The rank request of the items (None: there are none)."""
    if not items:
        return None
    return RankRequest(history=body.history, candidates=[i.item_id for i in items], request_id=body.request_id)


def merge(
    items: list[RecommendedItem],
    retrieved: RetrieveResult,
    ranked: RankResult | None,
    task: str,
    num_results: int,
    version: str,
) -> RecommendResult:
    """The items in the funnel's final order (genrec.funnel.final_order), the first `num_results`."""
    scores = {item.item_id: item.scores for item in (ranked.items if ranked is not None else [])}
    order = final_order([item.item_id for item in items], scores, task)
    kept = [items[k] for k in order[:num_results]]
    return RecommendResult(
        request_id=retrieved.request_id,
        items=[item.model_copy(update={"ranker_scores": scores.get(item.item_id)}) for item in kept],
        prompt_tokens=retrieved.prompt_tokens,
        unknown_exclusions=retrieved.unknown_exclusions,
        catalog_version=retrieved.catalog_version,
        rank_task=task,
        ranker_version=version,
    )


def degraded(
    items: list[RecommendedItem], retrieved: RetrieveResult, num_results: int | None, reason: str
) -> RecommendResult:
    """Stage 1's answer alone, after stage 2 failed: the items in the final order with nothing ranked (beam
    order, the given ones after), the first `num_results`, marked with why. No ranker: no task, no version."""
    order = final_order([item.item_id for item in items], {}, "")
    return RecommendResult(
        request_id=retrieved.request_id,
        items=[items[k] for k in order[:num_results]],
        prompt_tokens=retrieved.prompt_tokens,
        unknown_exclusions=retrieved.unknown_exclusions,
        catalog_version=retrieved.catalog_version,
        degraded=True,
        degraded_reason=reason,
    )


def known_candidates(request: RankRequest, knows) -> RankRequest | None:
    """The ranker's side: the request with only the candidates its catalog holds (None: it holds none)."""
    candidates = known(request.candidates, knows)
    return request.model_copy(update={"candidates": candidates}) if candidates else None
