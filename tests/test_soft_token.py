"""Soft-token user embeddings against transformers run on inputs_embeds with the placeholder row replaced."""

import numpy as np
import pytest
import torch

from genrec.api import Candidate, RetrieveRequest, ScoreRequest
from genrec.errors import InvalidRequestError
from genrec.model.tokenizer import USER_TOKEN
from tests.conftest import random_prompt
from tests.reference import teacher_forced_logprobs
from tests.test_score import hf_label_scores, label_ids

TOL = 1e-4


def prompt_with_placeholders(engine, rng, count=1):
    tokens = random_prompt(engine, 24, rng)
    user = engine.family.tokenizer.convert_tokens_to_ids(USER_TOKEN)
    for position in (3, 15)[:count]:
        tokens[position] = user
    return tokens


def reference_embeds(engine, hf_model, tokens, vector):
    """transformers' input embeddings with every placeholder row replaced by weight @ v + bias."""
    with torch.no_grad():
        embeds = hf_model.get_input_embeddings()(torch.tensor(tokens)).clone()
        projected = engine.family.projector.weight @ torch.tensor(vector) + engine.family.projector.bias
        embeds[torch.tensor(tokens) == engine.family.placeholder_id] = projected
    return embeds


@pytest.mark.parametrize("placeholders", [1, 2])
def test_retrieve_with_user_embedding_equals_transformers(arch_engine, arch_hf_model, rng, placeholders):
    engine, hf_model = arch_engine, arch_hf_model  # each decoder architecture's
    tokens = prompt_with_placeholders(engine, rng, placeholders)
    vector = torch.randn(engine.family.projector.user_dim, generator=rng).tolist()
    request = RetrieveRequest(prompt_token_ids=tokens, user_embedding=vector, beam_width=len(engine.catalog))
    (result,) = engine.retrieve([request])
    embeds = reference_embeds(engine, hf_model, tokens, vector)
    scores = teacher_forced_logprobs(hf_model, tokens, engine.catalog.codes, inputs_embeds=embeds)
    order = scores.argsort(descending=True).tolist()
    assert [i.item_id for i in result.items] == [engine.catalog.item_ids[j] for j in order]
    assert np.allclose([i.logprob for i in result.items], scores[order].numpy(), atol=TOL)


def test_score_with_user_embedding_equals_transformers(arch_engine, arch_hf_model, rng):
    engine, hf_model = arch_engine, arch_hf_model  # each decoder architecture's
    tokens = prompt_with_placeholders(engine, rng)
    vector = torch.randn(engine.family.projector.user_dim, generator=rng).tolist()
    candidates = [[engine.catalog.codes[i].tolist()] for i in (0, 9, 77)]
    request = ScoreRequest(
        prompt_token_ids=tokens, user_embedding=vector, candidates=[Candidate(token_ids=c[0]) for c in candidates]
    )
    (result,) = engine.score([request])
    embeds = reference_embeds(engine, hf_model, tokens, vector)
    want, _ = hf_label_scores(hf_model, tokens, [c[0] for c in candidates], *label_ids(engine), inputs_embeds=embeds)
    assert [s.logprob for s in result.scores] == pytest.approx(want, abs=TOL)


def test_a_different_user_vector_changes_the_result(engine, rng):
    tokens = prompt_with_placeholders(engine, rng)
    a, b = (torch.randn(engine.family.projector.user_dim, generator=rng).tolist() for _ in range(2))
    (ra, rb) = engine.retrieve(
        [RetrieveRequest(prompt_token_ids=tokens, user_embedding=v, beam_width=10) for v in (a, b)]
    )
    assert [i.logprob for i in ra.items] != pytest.approx([i.logprob for i in rb.items], abs=1e-3)


def test_user_embedding_errors(engine, rng):
    tokens = prompt_with_placeholders(engine, rng)
    plain = random_prompt(engine, 10, rng)
    dim = engine.family.projector.user_dim
    with pytest.raises(InvalidRequestError, match="no <|user|> placeholder"):
        engine.retrieve([RetrieveRequest(prompt_token_ids=plain, user_embedding=[0.0] * dim)])
    with pytest.raises(InvalidRequestError, match=f"expects {dim}"):
        engine.retrieve([RetrieveRequest(prompt_token_ids=tokens, user_embedding=[0.0] * (dim + 1))])
    with pytest.raises(InvalidRequestError, match="placeholder but no user_embedding"):
        engine.retrieve([RetrieveRequest(prompt_token_ids=tokens)])
    with pytest.raises(ValueError, match="non-finite"):
        RetrieveRequest(prompt_token_ids=tokens, user_embedding=[float("nan")] * dim)
    with pytest.raises(ValueError, match="non-finite"):
        RetrieveRequest(prompt_token_ids=tokens, user_embedding=[float("inf")] * dim)


def test_projector_is_a_trainable_linear_layer(engine):
    assert isinstance(engine.family.projector, torch.nn.Linear)
    assert engine.family.projector.weight.shape == (engine.model.config.hidden_size, engine.family.projector.user_dim)


def test_a_user_embedding_whose_projection_overflows_the_model_dtype_is_refused(engine, rng):
    tokens = prompt_with_placeholders(engine, rng)
    dim = engine.family.projector.user_dim
    for vector in ([3e38] * dim, [1e300] + [0.0] * (dim - 1), [3e38, -3e38] * (dim // 2)):
        request = RetrieveRequest(prompt_token_ids=tokens, user_embedding=vector)  # finite in float64: valid
        with pytest.raises(InvalidRequestError, match="user_embedding.*overflow torch.float32"):
            engine.retrieve([request])
    largest = [1e37 / engine.family.projector.largest_partial_sum([1.0] * dim)] * dim  # projects within float32
    (result,) = engine.retrieve([RetrieveRequest(prompt_token_ids=tokens, user_embedding=largest, beam_width=4)])
    assert len(result.items) == 4 and all(np.isfinite(i.logprob) for i in result.items)


def test_no_result_ever_carries_a_non_finite_score(engine, rng):
    """Numbers gone wrong inside the model (here a projector with a NaN bias) fail the request, never its scores."""
    import asyncio

    from genrec.api import RecommendRequest
    from genrec.engine import AsyncEngine, Engine
    from genrec.engine.retriever import Retriever
    from genrec.model.soft_token import SoftTokenProjector

    broken = SoftTokenProjector(engine.family.projector.user_dim, engine.model.config.hidden_size)
    with torch.no_grad():
        broken.weight.copy_(engine.family.projector.weight)
        broken.bias.copy_(engine.family.projector.bias)
        broken.bias[0] = float("nan")
    nan_engine = Engine(Retriever(engine.model, engine.family.tokenizer, engine.catalog, broken))
    tokens, vector = prompt_with_placeholders(engine, rng), [0.5] * engine.family.projector.user_dim
    requests = [
        RetrieveRequest(prompt_token_ids=tokens, user_embedding=vector, beam_width=4),
        ScoreRequest(prompt_token_ids=tokens, user_embedding=vector, candidates=[Candidate(text="news")]),
        RecommendRequest(prompt_token_ids=tokens, user_embedding=vector, beam_width=4),
    ]
    for request, method in zip(requests, (nan_engine.retrieve, nan_engine.score, nan_engine.recommend), strict=True):
        with pytest.raises(InvalidRequestError, match="not finite"):
            method([request])

    healthy = RetrieveRequest(prompt_token_ids=random_prompt(engine, 12, rng), beam_width=4)
    ae = AsyncEngine(nan_engine)

    async def together():
        calls = [ae.retrieve(requests[0]), ae.score(requests[1]), ae.recommend(requests[2]), ae.retrieve(healthy)]
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60)

    try:
        *failed, fine = asyncio.run(together())
    finally:
        ae.shutdown()
    assert all(isinstance(f, InvalidRequestError) and "not finite" in str(f) for f in failed)
    assert [i.item_id for i in fine.items] == [i.item_id for i in engine.retrieve([healthy])[0].items]


def test_a_projector_with_non_finite_values_is_refused_at_load(engine, tmp_path):
    from safetensors.torch import save_file

    from genrec.errors import ModelDirectoryError
    from genrec.model.soft_token import SoftTokenProjector

    weight = engine.family.projector.weight.detach().clone()
    weight[1, 2] = float("inf")
    path = tmp_path / "soft_token.safetensors"
    save_file({"weight": weight, "bias": engine.family.projector.bias.detach().clone()}, str(path))
    with pytest.raises(ModelDirectoryError, match="non-finite"):
        SoftTokenProjector.load(path, engine.model.config.hidden_size)


@pytest.mark.parametrize("kind", ["score", "recommend"])
def test_a_candidate_holding_the_placeholder_is_refused_at_its_field(engine, rng, kind):
    """Found by a hostile probe: a candidate's rows never take the user embedding, so a placeholder there was scored
    on its raw, untrained embedding (and without any user_embedding): the same tokens split another way between
    prompt and candidate scored differently."""
    from genrec.api import RecommendRequest

    user = engine.family.tokenizer.convert_tokens_to_ids(USER_TOKEN)
    vector = torch.randn(engine.family.projector.in_features, generator=rng).tolist()
    prompt = random_prompt(engine, 12, rng) + [user]
    for candidate, field in (
        (Candidate(token_ids=[user, 7]), "token_ids"),
        (Candidate(text=f"{USER_TOKEN} yes"), "text"),
    ):
        fields = dict(prompt_token_ids=prompt, user_embedding=vector, candidates=[Candidate(token_ids=[5]), candidate])
        request = ScoreRequest(**fields) if kind == "score" else RecommendRequest(**fields, beam_width=4)
        with pytest.raises(InvalidRequestError, match=rf"candidates\[1\]\.{field}: holds the <\|user\|> placeholder"):
            (engine.score if kind == "score" else engine.recommend)([request])


def test_an_integer_too_large_for_a_float_is_told_so():
    """Found by a hostile probe: JSON's integers are taken for numbers, but one past a float's range was told
    'must be a number; got a number'."""
    from pydantic import ValidationError

    from genrec.api import located_error

    with pytest.raises(ValidationError) as caught:
        ScoreRequest.model_validate_json(
            '{"prompt": "a", "user_embedding": [1' + "0" * 400 + ', 1], "candidates": [{"token_ids": [1]}]}'
        )
    (error,) = caught.value.errors()
    assert located_error(error, ScoreRequest) == (
        "user_embedding[0]",
        "must be a number; got a number too large for a float",
    )
