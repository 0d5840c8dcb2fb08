"""The two-stage recommend (an app with a ranker, a body with `history`): each stage's request, and the merge
(docs/serving.md, "Two stages: the funnel online"; the policy is genrec.funnel's). One deadline: stage 1 gets it
less a reserve for stage 2 (`stage1_timeout`). When stage 2 fails the answer is stage 1's, marked `degraded`; a
client's mistake the ranker finds stays its 4xx. No Ray here: the ingress makes the calls.
"""

from __future__ import annotations

from genrec.api import (
    RankRequest,
    RankResult,
    RecommendedItem,
    RecommendRequest,
    RecommendResult,
)
from genrec.errors import EngineStopped, InvalidRequestError, Overloaded, RequestTimeout
from genrec.funnel import final_order
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
    """What the ranker would refuse, refused before stage 1 (before stage 2 when its facts must be asked of it);
    returns the task the items are ordered by."""
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


def stage1(request: RecommendRequest) -> RecommendRequest:
    """The retriever's recommend in beam order with every beam kept: the ranker decides which are returned."""
    fields = request.model_dump(exclude={"rank_by", "num_results"})
    return RecommendRequest.model_validate(fields | {"rank_by": "beam", "num_results": request.beam_width})


def stage2(body: RecommendBody, items: list[RecommendedItem]) -> RankRequest | None:
    """The rank request of the items, those the ranker does not know skipped (None: there are none)."""
    if not items:
        return None
    candidates = [i.item_id for i in items]
    return RankRequest(
        history=body.history, candidates=candidates, request_id=body.request_id, unknown_candidates="skip"
    )


def merge(
    stage1: RecommendResult, ranked: RankResult | None, task: str, num_results: int, version: str
) -> RecommendResult:
    """Stage 1's items in the funnel's final order (genrec.funnel.final_order), the first `num_results`."""
    scores = {item.item_id: item.scores for item in (ranked.items if ranked is not None else [])}
    order = final_order([item.item_id for item in stage1.items], scores, task)
    kept = [stage1.items[k] for k in order[:num_results]]
    return stage1.model_copy(
        update={
            "items": [item.model_copy(update={"ranker_scores": scores.get(item.item_id)}) for item in kept],
            "rank_task": task,
            "ranker_version": version,
        }
    )


def degraded(stage1: RecommendResult, num_results: int | None, reason: str) -> RecommendResult:
    """Stage 1's answer alone after stage 2 failed: the final order with nothing ranked, marked with why."""
    order = final_order([item.item_id for item in stage1.items], {}, "")
    items = [stage1.items[k] for k in order[:num_results]]
    return stage1.model_copy(update={"items": items, "degraded": True, "degraded_reason": reason})
