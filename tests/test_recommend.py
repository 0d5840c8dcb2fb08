"""recommend = retrieve, then score the retrieved items (plus given candidates), on one prefill."""

import pytest

from genrec.api import Candidate, RecommendRequest, RetrieveRequest, ScoreRequest
from tests.conftest import random_prompt


def test_recommend_equals_retrieve_then_score(engine, rng):
    tokens = random_prompt(engine, 33, rng)
    given = [Candidate(item_id="item-000123"), Candidate(text="news daily")]
    (rec,) = engine.recommend(
        [RecommendRequest(prompt_token_ids=tokens, beam_width=12, num_results=8, candidates=given)]
    )
    (ret,) = engine.retrieve([RetrieveRequest(prompt_token_ids=tokens, beam_width=12, num_results=8)])
    scored_candidates = [Candidate(item_id=i.item_id) for i in ret.items] + given
    (sco,) = engine.score([ScoreRequest(prompt_token_ids=tokens, candidates=scored_candidates)])

    assert len(rec.items) == 10
    by_key = {(i.source, i.item_id): i for i in rec.items}
    for item, score in zip(ret.items, sco.scores, strict=False):
        got = by_key[("retrieved", item.item_id)]
        assert got.retrieval_logprob == pytest.approx(item.logprob, abs=1e-5)
        assert got.score_logprob == pytest.approx(score.logprob, abs=1e-5)
        assert got.prob == pytest.approx(score.prob, abs=1e-5)
    assert by_key[("given", "item-000123")].score_logprob == pytest.approx(sco.scores[8].logprob, abs=1e-5)
    text = [i for i in rec.items if i.source == "given" and i.item_id is None]
    assert text[0].score_logprob == pytest.approx(sco.scores[9].logprob, abs=1e-5)
    ranked = [i.score_logprob for i in rec.items]
    assert ranked == sorted(ranked, reverse=True)


def test_recommend_prefills_once(engine, rng, monkeypatch):
    segments = []
    original = engine.model.prefill_packed
    monkeypatch.setattr(engine.model, "prefill_packed", lambda segs: segments.extend(segs) or original(segs))
    engine.recommend([RecommendRequest(prompt_token_ids=random_prompt(engine, 9, rng), beam_width=4)])
    assert len(segments) == 1


def test_an_excluded_candidate_is_dropped_and_a_retrieved_one_given_again_appears_once(engine, rng):
    tokens = random_prompt(engine, 21, rng)
    (plain,) = engine.retrieve([RetrieveRequest(prompt_token_ids=tokens, beam_width=6)])
    unretrieved = [i for i in engine.catalog.item_ids if i not in {r.item_id for r in plain.items}]
    excluded, outside = unretrieved[0], unretrieved[1]
    (ret,) = engine.retrieve([RetrieveRequest(prompt_token_ids=tokens, beam_width=6, exclude_item_ids=[excluded])])
    retrieved = [i.item_id for i in ret.items]
    given = [
        Candidate(item_id=retrieved[0]),  # also retrieved: one row, both sources
        Candidate(item_id=excluded),  # also excluded: dropped
        Candidate(item_id=outside),
        Candidate(item_id=outside),  # given twice: one row
        Candidate(text="news daily"),
    ]
    request = RecommendRequest(prompt_token_ids=tokens, beam_width=6, candidates=given, exclude_item_ids=[excluded])
    (rec,) = engine.recommend([request])
    rows = [(i.item_id, i.source) for i in rec.items]
    assert len(rows) == len(set(rows)) == 6 + 2
    by_id = {i.item_id: i for i in rec.items}
    assert excluded not in by_id and outside not in retrieved
    assert by_id[retrieved[0]].source == "retrieved+given"
    assert by_id[retrieved[0]].retrieval_logprob == pytest.approx(ret.items[0].logprob, abs=1e-5)
    assert by_id[outside].source == "given" and by_id[None].source == "given"
    assert {i.item_id for i in rec.items if i.source == "retrieved"} == set(retrieved[1:])
    # the same scores as scoring each item once, alone
    ids = [i for i in by_id if i is not None]
    (sco,) = engine.score([ScoreRequest(prompt_token_ids=tokens, candidates=[Candidate(item_id=i) for i in ids])])
    assert [by_id[i].score_logprob for i in ids] == pytest.approx([s.logprob for s in sco.scores], abs=1e-5)


def test_given_candidates_follow_the_same_rules_in_the_async_engine(engine, rng):
    import asyncio

    from genrec.engine import AsyncEngine

    tokens = random_prompt(engine, 17, rng)
    (plain,) = engine.recommend([RecommendRequest(prompt_token_ids=tokens, beam_width=5)])
    request = RecommendRequest(
        prompt_token_ids=tokens,
        beam_width=5,
        candidates=[Candidate(item_id=plain.items[0].item_id), Candidate(item_id=plain.items[1].item_id)],
        exclude_item_ids=[plain.items[1].item_id],
    )
    ae = AsyncEngine(engine)
    try:
        got = asyncio.run(asyncio.wait_for(ae.recommend(request), 60))
    finally:
        ae.shutdown()
    (want,) = engine.recommend([request])
    assert [(i.item_id, i.source) for i in got.items] == [(i.item_id, i.source) for i in want.items]
    assert plain.items[1].item_id not in {i.item_id for i in got.items} and len(got.items) == 5
