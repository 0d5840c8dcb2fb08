"""Constrained wide beam search against transformers (teacher forcing and its own beam search)."""

import json
import shutil

import numpy as np
import pytest
from pydantic import ValidationError

from genrec.api import Candidate, RecommendRequest, RetrieveRequest, ScoreRequest
from genrec.errors import InvalidRequestError, ModelDirectoryError
from tests.conftest import random_prompt
from tests.reference import hf_constrained_beams, teacher_forced_logprobs

TOL = 1e-4


def exhaustive_ranking(engine, hf_model, prompt, keep=None):
    """Every catalog item scored by teacher forcing, best first: [(item_id, logprob)]."""
    index = np.arange(len(engine.catalog)) if keep is None else np.asarray(keep)
    scores = teacher_forced_logprobs(hf_model, prompt, engine.catalog.codes[index])
    order = scores.argsort(descending=True)
    return [(engine.catalog.item_ids[index[i]], scores[i].item()) for i in order.tolist()]


@pytest.mark.parametrize("prompt_len", [3, 40])
def test_full_width_beam_equals_exhaustive_scoring(arch_engine, arch_hf_model, rng, prompt_len):
    engine, hf_model = arch_engine, arch_hf_model  # each decoder architecture's
    prompt = random_prompt(engine, prompt_len, rng)
    (result,) = engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=len(engine.catalog))])
    want = exhaustive_ranking(engine, hf_model, prompt)
    assert [i.item_id for i in result.items] == [item for item, _ in want]
    assert max(abs(i.logprob - s) for i, (_, s) in zip(result.items, want, strict=True)) <= TOL


@pytest.mark.parametrize("beam_width", [1, 3, 7])
def test_narrow_beam_equals_transformers_beam_search(arch_engine, arch_hf_model, rng, beam_width):
    engine, hf_model = arch_engine, arch_hf_model  # each decoder architecture's
    prompt = random_prompt(engine, 30, rng)
    (result,) = engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=beam_width)])
    codes, scores = hf_constrained_beams(
        hf_model, prompt, engine.catalog.codes, beam_width, engine.family.tokenizer.pad_token_id
    )
    assert [i.semantic_id for i in result.items] == codes
    assert np.allclose([i.logprob for i in result.items], scores, atol=TOL)


def test_every_returned_code_is_a_catalog_item(engine, rng):
    requests = [RetrieveRequest(prompt_token_ids=random_prompt(engine, 10, rng), beam_width=64) for _ in range(4)]
    for result in engine.retrieve(requests):
        assert len(result.items) == 64
        for item in result.items:
            index = engine.catalog.index_of(item.item_id)
            assert engine.catalog.codes[index].tolist() == item.semantic_id
        logprobs = [i.logprob for i in result.items]
        assert logprobs == sorted(logprobs, reverse=True)


def test_exclusions_never_come_back_and_take_no_beams(arch_engine, arch_hf_model, rng):
    engine, hf_model = arch_engine, arch_hf_model  # each decoder architecture's
    prompt = random_prompt(engine, 20, rng)
    (plain,) = engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=5)])
    # Exclude the best item and every item under the best first-level token: a whole subtree dies.
    top_first = plain.items[0].semantic_id[0]
    dead_subtree = [i for i, code in enumerate(engine.catalog.codes) if code[0] == top_first]
    excluded = [engine.catalog.item_ids[i] for i in dead_subtree] + [plain.items[1].item_id]
    request = RetrieveRequest(prompt_token_ids=prompt, beam_width=5, exclude_item_ids=excluded)
    (result,) = engine.retrieve([request])
    assert len(result.items) == 5
    assert not {i.item_id for i in result.items} & set(excluded)
    # Same beams as transformers' beam search over the catalog without the excluded items.
    keep = [i for i in range(len(engine.catalog)) if engine.catalog.item_ids[i] not in set(excluded)]
    codes, scores = hf_constrained_beams(
        hf_model, prompt, engine.catalog.codes[keep], 5, engine.family.tokenizer.pad_token_id
    )
    assert [i.semantic_id for i in result.items] == codes
    # With a full-width beam, exactly the exhaustive ranking of the remaining items.
    full = RetrieveRequest(prompt_token_ids=prompt, beam_width=1024, exclude_item_ids=excluded)
    (everything,) = engine.retrieve([full])
    want = exhaustive_ranking(engine, hf_model, prompt, keep)
    assert [i.item_id for i in everything.items] == [item for item, _ in want]


def test_batch_of_mixed_requests_equals_each_alone(engine, rng):
    requests = [
        RetrieveRequest(prompt_token_ids=random_prompt(engine, 5, rng), beam_width=1),
        RetrieveRequest(prompt_token_ids=random_prompt(engine, 60, rng), beam_width=40, num_results=10),
        RetrieveRequest(prompt="user listened to comedy podcast", beam_width=7),
        RetrieveRequest(
            prompt_token_ids=random_prompt(engine, 17, rng), beam_width=300, exclude_item_ids=["item-000003"]
        ),
    ]
    together = engine.retrieve(requests)
    for request, result in zip(requests, together, strict=True):
        (alone,) = engine.retrieve([request])
        assert [i.item_id for i in result.items] == [i.item_id for i in alone.items]
        assert np.allclose([i.logprob for i in result.items], [i.logprob for i in alone.items], atol=1e-5)
    assert [len(r.items) for r in together] == [1, 10, 7, 299]


def test_catalog_smaller_than_num_results_returns_what_exists(engine, rng):
    request = RetrieveRequest(prompt_token_ids=random_prompt(engine, 8, rng), beam_width=1024, num_results=1000)
    (result,) = engine.retrieve([request])
    assert len(result.items) == len(engine.catalog)


def test_unknown_exclusions_are_ignored_and_counted(engine, rng):
    request = RetrieveRequest(
        prompt_token_ids=random_prompt(engine, 8, rng), beam_width=4, exclude_item_ids=["nope", "item-000001", "x"]
    )
    (result,) = engine.retrieve([request])
    assert result.unknown_exclusions == 2
    assert "item-000001" not in {i.item_id for i in result.items}


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"prompt": ""}, "empty"),
        ({"prompt": "   "}, "empty"),
        ({"prompt_token_ids": []}, "empty"),
        ({}, "exactly one"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one"),
        ({"prompt": "a", "beam_width": 0}, "beam_width"),
        ({"prompt": "a", "beam_width": 1025}, "beam_width"),
        ({"prompt": "a", "beam_width": 4, "num_results": 5}, "num_results"),
        ({"prompt_token_ids": [-1]}, "prompt_token_ids"),
        ({"prompt": "a", "surprise": 1}, "surprise"),
        # strict types: nothing is coerced (issue 13, item 9)
        ({"prompt_token_ids": [True, False]}, "prompt_token_ids.0"),
        ({"prompt_token_ids": ["1", "2"]}, "prompt_token_ids.0"),
        ({"prompt_token_ids": [2.0]}, "prompt_token_ids.0"),
        ({"prompt": "a", "beam_width": True}, "beam_width"),
        ({"prompt": "a", "beam_width": 4.0}, "beam_width"),
        ({"prompt": "a", "beam_width": "4"}, "beam_width"),
        ({"prompt": "a", "num_results": "3"}, "num_results"),
        ({"prompt": "a", "user_embedding": [True, 1.0]}, "user_embedding.0"),
        ({"prompt": "a", "user_embedding": ["0.5"]}, "user_embedding.0"),
        ({"prompt": "a", "exclude_item_ids": [7]}, "exclude_item_ids.0"),
        ({"prompt": "a", "request_id": 7}, "request_id"),
        ({"prompt": b"bytes"}, "prompt"),
        ({"prompt_token_ids": np.array([1.0, 2.0])}, "prompt_token_ids.0"),
        # text must be valid Unicode: a lone surrogate (a JSON escape away) is refused by field (item 5)
        ({"prompt": "\ud800abc"}, "lone surrogate"),
        ({"prompt": "a", "exclude_item_ids": ["item\udfff"]}, "exclude_item_ids.0"),
        ({"prompt": "a", "request_id": "\udc80"}, "request_id"),
    ],
)
def test_invalid_requests_fail_validation(fields, fragment):
    with pytest.raises(ValidationError) as info:
        RetrieveRequest(**fields)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "body, fragment",
    [
        ('{"prompt_token_ids": [true, false]}', "prompt_token_ids.0"),
        ('{"prompt_token_ids": ["1", "2"]}', "prompt_token_ids.0"),
        ('{"prompt_token_ids": [1.0]}', "prompt_token_ids.0"),
        ('{"prompt": "a", "beam_width": true}', "beam_width"),
        ('{"prompt": "a", "beam_width": 4.0}', "beam_width"),
        ('{"prompt": "a", "user_embedding": [false]}', "user_embedding.0"),
        ('{"prompt": "a", "user_embedding": ["1"]}', "user_embedding.0"),
        ('{"prompt": "\\ud800abc"}', "prompt"),
    ],
)
def test_json_bodies_are_validated_as_strictly(body, fragment):
    with pytest.raises(ValidationError) as info:
        RetrieveRequest.model_validate_json(body)
    assert fragment in str(info.value)
    with pytest.raises(ValidationError):  # the same body decoded first (what FastAPI does)
        RetrieveRequest.model_validate(json.loads(body))


def test_what_json_and_ray_data_send_is_still_accepted():
    from_json = RetrieveRequest.model_validate_json('{"prompt": "a", "user_embedding": [1, 0.5], "beam_width": 3}')
    assert from_json.user_embedding == [1.0, 0.5] and from_json.beam_width == 3
    from_arrays = RetrieveRequest(
        prompt_token_ids=np.array([5, 6], dtype=np.int64), user_embedding=np.ones(2, np.float32), beam_width=np.int64(2)
    )
    assert from_arrays.prompt_token_ids == [5, 6] and from_arrays.user_embedding == [1.0, 1.0]
    assert type(from_arrays.beam_width) is int and from_arrays.num_results == 2


def test_prompt_too_long_and_unknown_tokens(engine):
    too_long = RetrieveRequest(prompt_token_ids=[1] * (engine.family.max_prompt_tokens + 1))
    with pytest.raises(InvalidRequestError, match="at most"):
        engine.retrieve([too_long])
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.retrieve([RetrieveRequest(prompt_token_ids=[1, engine.model.config.vocab_size])])


def test_cohorts_at_different_levels_decode_together(engine, rng):
    """One decode pass over cohorts at different levels (padded suffixes, merged selection) == each alone."""
    from genrec.engine.beam import fetch_finals
    from genrec.engine.results import retrieve_result
    from genrec_bench import gpu_check

    requests = [
        RetrieveRequest(prompt_token_ids=random_prompt(engine, n, rng), beam_width=w, exclude_item_ids=ex)
        for n, w, ex in ((9, 5, []), (30, 17, ["item-000007"]), (4, 300, []), (12, 2, []))
    ]
    prepared = [engine.prepare(r) for r in requests]
    cohorts = gpu_check.pooled_cohorts(engine, prepared, engine.runner.new_pool(4096))
    engine.runner.decode(cohorts[:1])  # the first one runs ahead by a level
    while not all(c.done for c in cohorts):
        engine.runner.decode([c for c in cohorts if not c.done])
    finals = fetch_finals(cohorts)
    for request, p, c, host in zip(requests, prepared, cohorts, finals, strict=True):
        together = retrieve_result(p, c.results(host)[0])
        (alone,) = engine.retrieve([request])
        assert [i.item_id for i in together.items] == [i.item_id for i in alone.items]
        assert np.allclose([i.logprob for i in together.items], [i.logprob for i in alone.items], atol=1e-5)


def test_bfloat16_engine_runs_every_path_and_agrees_with_float32(tiny_dir, engine, rng):
    """The dtype casts the GPU path takes (bf16 weights, float32 softmax and merge), exercised on the CPU."""
    import torch

    from genrec.api import Candidate, RecommendRequest, ScoreRequest
    from genrec.engine import Engine

    half = Engine.from_pretrained(tiny_dir, dtype=torch.bfloat16)
    prompt = random_prompt(engine, 40, rng)
    request = RetrieveRequest(prompt_token_ids=prompt, beam_width=len(engine.catalog))
    (full,), (low,) = engine.retrieve([request]), half.retrieve([request])
    want = {i.item_id: i.logprob for i in full.items}
    got = {i.item_id: i.logprob for i in low.items}
    assert set(got) == set(want)
    assert max(abs(got[k] - want[k]) for k in want) < 0.5  # bf16 rounding, not a different model
    top_full = [i.item_id for i in full.items[:10]]
    assert all(i.item_id in top_full for i in low.items[:3])  # near-ties may swap in bf16, nothing more
    scored = half.score([ScoreRequest(prompt_token_ids=prompt, candidates=[Candidate(item_id="item-000001")])])
    assert np.isfinite(scored[0].scores[0].logprob)
    (rec,) = half.recommend([RecommendRequest(prompt_token_ids=prompt, beam_width=4)])
    assert len(rec.items) == 4


def test_empty_batches_return_empty_lists(engine):
    assert engine.retrieve([]) == [] and engine.score([]) == [] and engine.recommend([]) == []


def test_each_entry_takes_only_its_own_kind_of_request(engine):
    retrieve = RetrieveRequest(prompt="user liked")
    score = ScoreRequest(prompt="user liked", candidates=[Candidate(text="news")])
    recommend = RecommendRequest(prompt="user liked")
    for method, wrong in [
        (engine.retrieve, score),
        (engine.retrieve, recommend),  # a RecommendRequest is a RetrieveRequest, but not what retrieve serves
        (engine.score, retrieve),
        (engine.recommend, retrieve),
        (engine.recommend, score),
    ]:
        with pytest.raises(InvalidRequestError, match=f"expected .*Request, got {type(wrong).__name__}") as info:
            method([wrong])
        assert info.value.field == "request"
    with pytest.raises(InvalidRequestError, match="expected ScoreRequest, got RetrieveRequest"):
        engine.score([score, retrieve])  # one wrong kind fails the batch before any compute
    with pytest.raises(InvalidRequestError, match="expected a list of requests, got RetrieveRequest"):
        engine.retrieve(retrieve)
    with pytest.raises(InvalidRequestError, match="got dict"):
        engine.prepare({"prompt": "user liked"})


def test_a_tokenizer_beyond_the_model_vocabulary_is_refused_at_load(tiny_dir, tmp_path):
    from genrec.engine import Engine
    from genrec.model.tokenizer import load_tokenizer

    model_dir = shutil.copytree(tiny_dir, tmp_path / "model")
    tokenizer = load_tokenizer(model_dir)
    tokenizer.add_tokens(["<beyond_0>", "<beyond_1>"])  # IDs past config.json's vocab_size
    tokenizer.save_pretrained(str(model_dir))
    with pytest.raises(ModelDirectoryError, match=r"token IDs up to \d+ \('<beyond_1>'\).*vocab_size"):
        Engine.from_pretrained(model_dir)
