"""The two-stage recommend (an app with a ranker, a body with `history`): what each stage is sent, and the merge.

Two calls. Stage 1, the retriever's recommend in beam order (rank_by 'beam': nothing scored) with every beam
returned: the retrieved items, then the given item_id candidates the decoder's one rule keeps (none excluded,
none its filters or allowed_item_ids disallow, each once, in order; an item also retrieved appears once, as
retrieved), as a single-stage recommend keeps them. Stage 2, the ranker's rank of those items after the user's
history, skipping those its catalog does not hold (RankRequest.unknown_candidates 'skip', in the ranker, after
it checked the history: the two models' catalogs may differ). The answer, those items in genrec.funnel's
final order: ordered by the ranker's probability for `rank_task` (ties in stage-1 order), the items it did not
rank after them in stage-1 order, with `ranker_scores` None. A ranker that knows none of them ranks none: the
answer is stage 1's order, not an error (the nightly funnel answers the same).

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


def stage1(request: RecommendRequest) -> RecommendRequest:
    """The retriever's recommend in beam order with every beam kept: the ranker, not the beam order, decides which
    are returned."""
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
    """Stage 1's answer alone, after stage 2 failed: the items in the final order with nothing ranked (beam
    order, the given ones after), the first `num_results`, marked with why. No ranker: no task, no version."""
    order = final_order([item.item_id for item in stage1.items], {}, "")
    items = [stage1.items[k] for k in order[:num_results]]
    return stage1.model_copy(update={"items": items, "degraded": True, "degraded_reason": reason})
