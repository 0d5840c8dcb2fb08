"""recommend = retrieve, then score the retrieved items (plus given candidates), on one prefill."""

import pytest
import torch
from pydantic import ValidationError

from genrec.api import Candidate, RecommendRequest, RetrieveRequest, ScoreRequest
from genrec.errors import InvalidRequestError
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
    monkeypatch.setattr(
        engine.model, "prefill_packed", lambda segs, *args, **kw: segments.extend(segs) or original(segs, *args, **kw)
    )
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


def test_beam_order_is_the_beams_then_the_given_items_a_scored_recommend_keeps_nothing_scored(engine, rng, monkeypatch):
    """rank_by 'beam' (a two-stage recommend's stage 1): the retrieved items in beam order, then the given ones
    kept by the one rule (no excluded or disallowed item, each once, in order), the same items the label's
    recommend of the same request returns; and no scoring pass runs."""
    tokens = random_prompt(engine, 21, rng)
    (plain,) = engine.retrieve([RetrieveRequest(prompt_token_ids=tokens, beam_width=6)])
    retrieved = [i.item_id for i in plain.items]
    others = [i for i in engine.catalog.item_ids if i not in set(retrieved)]
    given = [others[0], retrieved[1], others[1], others[0], others[2], others[3], retrieved[0]]
    excluded, allowed = [others[2], retrieved[0]], [*retrieved, *others[:3], *others[4:40]]
    fields = {"prompt_token_ids": tokens, "beam_width": 6, "exclude_item_ids": excluded, "allowed_item_ids": allowed}
    request = RecommendRequest(**fields, candidates=[Candidate(item_id=g) for g in given])
    (ref,) = engine.retrieve([RetrieveRequest(**fields)])
    (scored,) = engine.recommend([request])

    def no_scoring(*_):
        raise AssertionError("rank_by 'beam' ran a scoring pass")

    monkeypatch.setattr(engine.family.scorer, "score_pass", no_scoring)
    (beam,) = engine.recommend([RecommendRequest(**fields, candidates=request.candidates, rank_by="beam")])
    kept = [g for g in dict.fromkeys(given) if g not in excluded and g in allowed]
    found = [i.item_id for i in ref.items]
    want = [(i, "retrieved+given" if i in kept else "retrieved") for i in found]
    want += [(g, "given") for g in kept if g not in found]
    assert {source for _, source in want} == {"retrieved", "retrieved+given", "given"}  # each case met
    assert [(i.item_id, i.source) for i in beam.items] == want
    assert sorted((i.item_id, i.source) for i in scored.items) == sorted(want)  # the label's recommend keeps them too
    assert [i.retrieval_logprob for i in beam.items[: len(found)]] == pytest.approx([i.logprob for i in ref.items])
    assert all(i.score_logprob is None and i.prob is None for i in beam.items)
    for item in beam.items[len(found) :]:
        assert item.semantic_id == engine.catalog.code(engine.catalog.index_of(item.item_id))
        assert item.retrieval_logprob is None and item.code_logprob is None
    assert (beam.prompt_tokens, beam.catalog_version) == (scored.prompt_tokens, scored.catalog_version)


@pytest.mark.parametrize(
    "fields, loc",
    [
        ({"labels": ["yes", "no"]}, ("labels",)),
        ({"candidates": [{"item_id": "item-000001"}, {"text": "news"}]}, ("candidates", 1)),
        ({"candidates": [{"token_ids": [5, 6]}]}, ("candidates", 0)),
    ],
)
def test_beam_order_takes_no_label_and_item_candidates_only(fields, loc):
    with pytest.raises(ValidationError) as info:
        RecommendRequest(prompt="x", rank_by="beam", **fields)
    assert [e["loc"] for e in info.value.errors()] == [loc]
    RecommendRequest(prompt="x", **fields)  # the label's recommend takes them


@torch.no_grad()
def hf_sequence_logprob(hf_model, prompt: list[int], tokens: list[int]) -> float:
    """log P(tokens | prompt) from one transformers forward: full-vocabulary log-softmax at each step."""
    logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).sum().item()


def joint_request(engine, rng, **options):
    tokens = random_prompt(engine, 26, rng)
    (plain,) = engine.retrieve([RetrieveRequest(prompt_token_ids=tokens, beam_width=6)])
    outside = [i for i in engine.catalog.item_ids if i not in {r.item_id for r in plain.items}][:2]
    given = [Candidate(item_id=outside[0]), Candidate(text="news daily"), Candidate(item_id=outside[1])]
    return tokens, RecommendRequest(prompt_token_ids=tokens, beam_width=6, candidates=given, **options)


def test_joint_ranking_adds_each_items_code_logprob_to_its_score(engine, hf_model, rng):
    tokens, request = joint_request(engine, rng, rank_by="joint")
    (rec,) = engine.recommend([request])
    (by_score,) = engine.recommend([request.model_copy(update={"rank_by": "score"})])
    given = [i for i in rec.items if i.source == "given"]
    assert len(rec.items) == 9 and len(given) == 3
    for item in rec.items:
        if item.source == "retrieved":
            assert item.code_logprob == item.retrieval_logprob
        else:  # computed in the scoring pass: equal to transformers over prompt + the candidate's tokens
            cand = item.semantic_id or engine.family.tokenizer("news daily", add_special_tokens=False)["input_ids"]
            assert item.code_logprob == pytest.approx(hf_sequence_logprob(hf_model, tokens, cand), abs=1e-4)
    joint = [i.code_logprob + i.score_logprob for i in rec.items]
    assert joint == sorted(joint, reverse=True)
    (weighted,) = engine.recommend([request.model_copy(update={"score_weight": 0.25})])
    keys = [i.code_logprob + 0.25 * i.score_logprob for i in weighted.items]
    assert keys == sorted(keys, reverse=True) and sorted(keys) != sorted(joint)
    # the same rows and scores as rank_by="score"; only the order and the given rows' code_logprob differ
    assert all(i.code_logprob is None for i in by_score.items if i.source == "given")
    key = {(i.item_id, i.source): i.score_logprob for i in by_score.items}
    assert {(i.item_id, i.source): i.score_logprob for i in rec.items} == pytest.approx(key, abs=1e-6)


def test_a_given_items_code_logprob_equals_its_beam_logprob(engine, rng):
    tokens = random_prompt(engine, 31, rng)
    (wide,) = engine.retrieve([RetrieveRequest(prompt_token_ids=tokens, beam_width=12)])
    found = wide.items[4:10]  # found by the wide beam; a beam of 2 keeps at most two of them
    request = RecommendRequest(
        prompt_token_ids=tokens, beam_width=2, candidates=[Candidate(item_id=i.item_id) for i in found], rank_by="joint"
    )
    (rec,) = engine.recommend([request])
    got = {i.item_id: i.code_logprob for i in rec.items}
    assert all(got[i.item_id] == pytest.approx(i.logprob, abs=1e-5) for i in found)


def test_joint_ranking_is_the_same_in_chunked_passes_and_the_async_engine(tiny_dir, engine, rng):
    import asyncio

    from genrec.engine import AsyncEngine, Engine

    _, request = joint_request(engine, rng, rank_by="joint")
    (want,) = engine.recommend([request])
    small = Engine.from_pretrained(tiny_dir, score_max_tokens=4)  # a pass or more per candidate
    (chunked,) = small.recommend([request])
    ae = AsyncEngine(engine)
    try:
        served = asyncio.run(asyncio.wait_for(ae.recommend(request), 60))
    finally:
        ae.shutdown()
    for got in (chunked, served):
        assert [(i.item_id, i.source) for i in got.items] == [(i.item_id, i.source) for i in want.items]
        assert [i.code_logprob for i in got.items] == pytest.approx([i.code_logprob for i in want.items], abs=1e-5)


@pytest.mark.parametrize(
    "field, value",
    [
        ("rank_by", "retrieval"),
        ("score_weight", -1.0),
        ("score_weight", float("nan")),
        ("score_weight", 1e308),
        ("score_weight", "1"),
    ],
)
def test_ranking_options_are_checked(field, value):
    with pytest.raises(ValidationError, match=field):
        RecommendRequest(prompt="x", **{"rank_by": "joint", field: value})
    with pytest.raises(ValidationError, match="'score_weight' applies to rank_by 'joint' only"):
        RecommendRequest(prompt="x", score_weight=0.5)


def test_a_non_finite_code_logprob_fails_the_request_clearly(engine, rng, monkeypatch):
    _, request = joint_request(engine, rng, rank_by="joint")
    monkeypatch.setattr(
        engine.family.scorer, "_token_logprobs", lambda hidden, tokens, rows=512: hidden[:, 0] * torch.nan
    )
    with pytest.raises(InvalidRequestError, match="not finite"):
        engine.recommend([request])
    (by_score,) = engine.recommend([request.model_copy(update={"rank_by": "score"})])  # asks for none: unaffected
    assert len(by_score.items) == 9


@pytest.mark.parametrize("given", [[[7], [11], [5, 9]], [[7], [11]]])  # one-token ones: only the prompt is read
def test_one_token_candidates_get_their_code_logprob_too(engine, hf_model, rng, given):
    tokens = random_prompt(engine, 12, rng)
    request = RecommendRequest(
        prompt_token_ids=tokens, beam_width=2, candidates=[Candidate(token_ids=t) for t in given], rank_by="joint"
    )
    (rec,) = engine.recommend([request])
    got = sorted(i.code_logprob for i in rec.items if i.source == "given")
    assert got == pytest.approx(sorted(hf_sequence_logprob(hf_model, tokens, t) for t in given), abs=1e-4)
