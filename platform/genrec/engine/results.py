"""A finished decoder request's result: catalog items, scores checked finite, recommend's ranking. All on host
data, after the one fetch at the end of a request (`genrec.staging.fetch`).
"""

from __future__ import annotations

import math

import torch

from genrec.api import (
    CandidateScore,
    RecommendedItem,
    RecommendRequest,
    RecommendResult,
    RetrievedItem,
    RetrieveResult,
    ScoreResult,
)
from genrec.engine.scoring import LabelScores, not_retrieved
from genrec.errors import InvalidRequestError
from genrec.staging import fetch


def retrieve_result(prepared, beams: list[tuple[int, float]]) -> RetrieveResult:
    """beams: (code, logprob) best first. The first `num_results` codes, each with its items not excluded and
    allowed by the filter, adjacent, in the order of the catalog version the request was prepared with."""
    check_finite([s for _, s in beams])
    catalog, trie = prepared.served.catalog, prepared.served.trie
    excluded = set(prepared.exclusions or ())
    allowed = prepared.filter.items if prepared.filter is not None else None
    items = []
    codes = beams[: prepared.request.num_results]
    for code, logprob in codes:
        for i in trie.items_of(code).tolist():
            if i not in excluded and (allowed is None or allowed[i]):
                items.append(RetrievedItem(item_id=catalog.item_ids[i], semantic_id=catalog.code(i), logprob=logprob))
    return RetrieveResult(
        request_id=prepared.request.request_id,
        items=items,
        codes=len(codes),
        prompt_tokens=len(prepared.token_ids),
        unknown_exclusions=prepared.unknown_exclusions,
        catalog_version=catalog.version,
    )


def score_result(prepared, scores: LabelScores) -> ScoreResult:
    logprobs, probs, _ = _fetch_scores(scores)
    items = [
        CandidateScore(item_id=c.item_id, logprob=lp, prob=pr)
        for c, lp, pr in zip(prepared.given, logprobs, probs, strict=True)
    ]
    return ScoreResult(
        request_id=prepared.request.request_id,
        scores=items,
        filtered_out=prepared.filtered_out,
        prompt_tokens=len(prepared.token_ids),
        catalog_version=prepared.served.version,
    )


def recommend_result(prepared, retrieved: RetrieveResult, scores: LabelScores) -> RecommendResult:
    catalog = prepared.served.catalog
    offset = len(retrieved.items)
    logprobs, probs, sequence = _fetch_scores(scores)
    # The given rows carry a sequence logprob exactly when the job asked for one (see scoring.candidate_rows).
    joint = prepared.request.rank_by == "joint"
    given_code = check_finite(sequence[offset:]) if joint else [None] * (len(sequence) - offset)
    given_ids = {c.item_id for c in prepared.given if c.item_id is not None}
    items = [
        RecommendedItem.retrieved(i, given_ids, score_logprob=lp, prob=pr)
        for i, lp, pr in zip(retrieved.items, logprobs, probs, strict=False)
    ]
    given = [prepared.given[k] for k in not_retrieved(prepared, retrieved)]
    for cand, lp, pr, code_lp in zip(given, logprobs[offset:], probs[offset:], given_code, strict=True):
        items.append(_given_item(catalog, cand, code_logprob=code_lp, score_logprob=lp, prob=pr))
    items.sort(key=_rank_key(prepared.request), reverse=True)
    return _recommend_result(prepared, retrieved, items)


def beam_order_result(prepared, retrieved: RetrieveResult) -> RecommendResult:
    """rank_by 'beam': the retrieved items in beam order, then the kept given ones (`Retriever._kept`) not retrieved."""
    given_ids = {c.item_id for c in prepared.given}
    items = [RecommendedItem.retrieved(i, given_ids) for i in retrieved.items]
    catalog = prepared.served.catalog
    items += [_given_item(catalog, prepared.given[k]) for k in not_retrieved(prepared, retrieved)]
    return _recommend_result(prepared, retrieved, items)


def _given_item(catalog, cand, **scores) -> RecommendedItem:
    """A given candidate as recommend returns it: its code when it is a catalog item; `scores`: those scored."""
    code = catalog.code(catalog.index_of(cand.item_id)) if cand.item_id else None
    return RecommendedItem(item_id=cand.item_id, semantic_id=code, source="given", **scores)


def _recommend_result(prepared, retrieved: RetrieveResult, items: list[RecommendedItem]) -> RecommendResult:
    return RecommendResult(
        request_id=prepared.request.request_id,
        items=items,
        prompt_tokens=retrieved.prompt_tokens,
        unknown_exclusions=retrieved.unknown_exclusions,
        catalog_version=prepared.served.catalog.version,
    )


def _rank_key(request: RecommendRequest):
    if request.rank_by == "joint":
        weight = request.score_weight
        return lambda item: item.code_logprob + weight * item.score_logprob
    return lambda item: item.score_logprob


def _fetch_scores(scores: LabelScores) -> tuple[list[float], list[float], list[float]]:
    """A request's label scores (checked finite) and sequence logprobs (NaN where not asked for: the caller
    checks the rows it asked for) on the host: the end of the request, one named fetch."""
    host = fetch(torch.stack((scores.logprob.double(), scores.prob.double(), scores.sequence.double())))
    return check_finite(host[0].tolist()), check_finite(host[1].tolist()), host[2].tolist()


def check_finite(values: list[float]) -> list[float]:
    """No result carries a NaN or infinite score: the request fails instead (host values: no device sync)."""
    if not all(map(math.isfinite, values)):
        raise InvalidRequestError(
            "request", "the model's scores for this request are not finite (e.g. a user_embedding too large)"
        )
    return values
