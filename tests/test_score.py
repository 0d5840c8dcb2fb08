"""Multi-candidate scoring in one pass, against each candidate run alone through transformers."""

import pytest
import torch
from pydantic import ValidationError

from genrec.api import Candidate, ScoreRequest
from genrec.engine.scoring import CandidateRows
from genrec.errors import InvalidRequestError
from tests.conftest import random_prompt

TOL = 1e-4


@torch.no_grad()
def hf_label_scores(hf_model, prompt, candidate_tokens, pos, neg, inputs_embeds=None):
    """One transformers forward per candidate (prefix + candidate): (logprob of pos, P(pos | pos or neg))."""
    logprobs, probs = [], []
    for tokens in candidate_tokens:
        if inputs_embeds is None:
            logits = hf_model(torch.tensor([prompt + tokens])).logits[0, -1]
        else:
            cand = hf_model.get_input_embeddings()(torch.tensor(tokens))
            logits = hf_model(inputs_embeds=torch.cat([inputs_embeds, cand])[None]).logits[0, -1]
        logprobs.append(torch.log_softmax(logits, -1)[pos].item())
        probs.append(torch.softmax(logits[[pos, neg]], -1)[0].item())
    return logprobs, probs


def label_ids(engine):
    return [engine.family.tokenizer.convert_tokens_to_ids(t) for t in ("yes", "no")]


def test_each_candidate_equals_scoring_it_alone(arch_engine, arch_hf_model, rng):
    engine, hf_model = arch_engine, arch_hf_model  # each decoder architecture's
    prompt = random_prompt(engine, 30, rng)
    candidates = [
        Candidate(item_id="item-000004"),
        Candidate(text="comedy podcast episode"),
        Candidate(token_ids=[7]),
        Candidate(token_ids=torch.randint(0, 200, (9,), generator=rng).tolist()),
        Candidate(item_id="item-000250"),
    ]
    (result,) = engine.score([ScoreRequest(prompt_token_ids=prompt, candidates=candidates)])
    tokens = [
        engine.catalog.codes[4].tolist(),
        engine.family.tokenizer("comedy podcast episode", add_special_tokens=False)["input_ids"],
        [7],
        candidates[3].token_ids,
        engine.catalog.codes[250].tolist(),
    ]
    want_lp, want_p = hf_label_scores(hf_model, prompt, tokens, *label_ids(engine))
    assert [s.item_id for s in result.scores] == ["item-000004", None, None, None, "item-000250"]
    assert max(abs(s.logprob - w) for s, w in zip(result.scores, want_lp, strict=True)) <= TOL
    assert max(abs(s.prob - w) for s, w in zip(result.scores, want_p, strict=True)) <= TOL


def test_many_candidates_and_chunked_passes_agree(engine, rng):
    prompt = random_prompt(engine, 50, rng)
    candidates = [Candidate(item_id=i) for i in engine.catalog.item_ids[:200]]
    (one_pass,) = engine.score([ScoreRequest(prompt_token_ids=prompt, candidates=candidates)])
    ctx = engine.runner.prefill_alone(engine.prepare(ScoreRequest(prompt_token_ids=prompt, candidates=candidates))).ctx
    codes = [c.tolist() for c in engine.catalog.codes[:200]]
    yes, no = label_ids(engine)
    (chunked,) = engine.family.scorer.score([CandidateRows(ctx, codes, (yes, no))], max_tokens=7)  # 2 candidates a pass
    assert torch.allclose(chunked.logprob, torch.tensor([s.logprob for s in one_pass.scores]), atol=1e-5)


def test_requests_batched_together_equal_each_alone(engine, rng):
    requests = [
        ScoreRequest(
            prompt_token_ids=random_prompt(engine, n, rng),
            candidates=[Candidate(token_ids=torch.randint(0, 200, (k,), generator=rng).tolist()) for k in (1, 4, 2)],
        )
        for n in (5, 41)
    ]
    together = engine.score(requests)
    for req, res in zip(requests, together, strict=True):
        (alone,) = engine.score([req])
        assert [s.logprob for s in res.scores] == pytest.approx([s.logprob for s in alone.scores], abs=1e-5)


def test_custom_labels(engine, hf_model, rng):
    prompt = random_prompt(engine, 10, rng)
    request = ScoreRequest(prompt_token_ids=prompt, candidates=[Candidate(token_ids=[3, 4])], labels=("no", "yes"))
    (result,) = engine.score([request])
    no, yes = label_ids(engine)[::-1]
    want_lp, want_p = hf_label_scores(hf_model, prompt, [[3, 4]], no, yes)
    assert result.scores[0].logprob == pytest.approx(want_lp[0], abs=TOL)
    assert result.scores[0].prob == pytest.approx(want_p[0], abs=TOL)


@pytest.mark.parametrize(
    "candidates, fragment",
    [
        ([], "candidates"),
        ([{"text": ""}], "empty"),
        ([{"text": "  "}], "empty"),
        ([{}], "exactly one"),
        ([{"item_id": "item-000001", "text": "x"}], "exactly one"),
        ([{"token_ids": []}], "empty"),
        ([{"token_ids": [True]}], "candidates.0.token_ids.0"),
        ([{"token_ids": [3.0]}], "candidates.0.token_ids.0"),
        ([{"token_ids": ["3"]}], "candidates.0.token_ids.0"),
        ([{"item_id": 17}], "candidates.0.item_id"),
        ([{"text": "news \ud800"}], "lone surrogate"),
    ],
)
def test_invalid_candidates_fail_validation(candidates, fragment):
    with pytest.raises(ValidationError) as info:
        ScoreRequest(prompt="hello", candidates=candidates)
    assert fragment in str(info.value)


def test_labels_take_a_json_list_of_two_strings_and_nothing_else():
    body = '{"prompt": "hello", "candidates": [{"token_ids": [1]}], "labels": ["no", "yes"]}'
    assert ScoreRequest.model_validate_json(body).labels == ("no", "yes")
    for labels in (["yes", 1], ["yes", "no", "maybe"], ["yes", "\udfff"]):
        with pytest.raises(ValidationError, match="labels"):
            ScoreRequest(prompt="hello", candidates=[{"token_ids": [1]}], labels=labels)


def test_engine_rejects_unknown_items_bad_labels_and_too_many(engine):
    def score(**fields):
        return engine.score([ScoreRequest(prompt="user liked", **fields)])

    with pytest.raises(InvalidRequestError, match=r"candidates\[1\].item_id.*unknown item 'nope'"):
        score(candidates=[{"item_id": "item-000001"}, {"item_id": "nope"}])
    with pytest.raises(InvalidRequestError, match=r"labels\[0\].*not a single token"):
        score(candidates=[{"token_ids": [1]}], labels=("podcast episode", "no"))
    with pytest.raises(InvalidRequestError, match=r"labels\[1\]"):
        score(candidates=[{"token_ids": [1]}], labels=("yes", ""))
    with pytest.raises(InvalidRequestError, match=r"candidates\[0\].token_ids.*outside"):
        score(candidates=[{"token_ids": [10**6]}])
    too_many = [{"token_ids": [1]}] * (engine.family.max_candidates + 1)
    with pytest.raises(InvalidRequestError, match="exceed this engine's limit"):
        score(candidates=too_many)
