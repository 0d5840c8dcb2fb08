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
