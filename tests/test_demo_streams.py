"""The demo's models draw each parameter from a named stream of its own: how one module is built (its draws, the
modules before it) cannot move another parameter's initial value."""

from dataclasses import replace

import numpy as np
import torch

from genrec.testing.tiny import build_tokenizer
from genrec_demo.config import DemoConfig
from genrec_demo.ranker.config import RankerConfig
from genrec_demo.ranker.train import new_model
from genrec_demo.streams import generator
from genrec_demo.train import new_models

RANKER = RankerConfig(window=8, hidden=16, heads=2, head_dim=8, head_hidden=16, time_buckets=8)
RETRIEVER = DemoConfig(levels=2, codebook=4, hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64)


def parameters(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_a_stream_is_fixed_by_its_seed_and_names():
    draw = lambda *key: torch.randn(4, generator=generator(*key))  # noqa: E731
    assert torch.equal(draw(0, "ranker", "a"), draw(0, "ranker", "a"))
    assert not torch.equal(draw(0, "ranker", "a"), draw(0, "ranker", "b"))
    assert not torch.equal(draw(0, "ranker", "a"), draw(1, "ranker", "a"))


def test_the_rankers_draws_ignore_the_global_stream_and_the_modules_beside_them():
    torch.manual_seed(0)
    plain = parameters(new_model(RANKER, 40))
    torch.manual_seed(123)
    torch.randn(1000)  # whatever else drew before
    assert parameters(new_model(RANKER, 40)).keys() == plain.keys()
    assert all(torch.equal(p, plain[name]) for name, p in parameters(new_model(RANKER, 40)).items())
    # A module built differently (no time-bucket embedding): every other parameter starts where it did.
    without = parameters(new_model(replace(RANKER, time_buckets=0), 40))
    assert "bucket_embedding.weight" in plain and "bucket_embedding.weight" not in without
    assert all(torch.equal(p, plain[name]) for name, p in without.items())
    other_seed = parameters(new_model(replace(RANKER, seed=1), 40))
    assert not torch.equal(other_seed["layers.0.uvqk.weight"], plain["layers.0.uvqk.weight"])


def test_the_rankers_scales_are_its_recipes():
    params = parameters(new_model(RANKER, 400))
    assert abs(float(params["item_embedding.weight"].std()) - RANKER.embedding_std) < 0.01
    assert torch.equal(params["final_norm.weight"], torch.ones(RANKER.hidden))
    assert torch.equal(params["layers.0.uvqk.bias"], torch.zeros_like(params["layers.0.uvqk.bias"]))
    bound = 1 / np.sqrt(RANKER.hidden)
    assert float(params["layers.0.uvqk.weight"].abs().max()) <= bound


def test_the_retrievers_draws_ignore_the_global_stream():
    tokenizer = build_tokenizer(RETRIEVER.levels, RETRIEVER.codebook)
    torch.manual_seed(0)
    model, projector = new_models(RETRIEVER, tokenizer, 3)
    torch.manual_seed(7)
    torch.randn(1000)
    again, projector_again = new_models(RETRIEVER, tokenizer, 3)
    for first, second in ((model, again), (projector, projector_again)):
        assert all(torch.equal(p, q) for p, q in zip(first.parameters(), second.parameters(), strict=True))
    std = float(parameters(model)["model.layers.0.self_attn.q_proj.weight"].std())
    assert abs(std - 0.02) < 0.004  # transformers' initializer_range
    assert torch.equal(parameters(model)["model.norm.weight"], torch.ones(RETRIEVER.hidden))
