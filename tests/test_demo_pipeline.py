"""The demo end to end on a slice of MovieLens (few users, a few training steps)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from genrec.api import RetrieveRequest
from genrec.demo import DemoConfig, run_demo
from genrec.demo.data import load_movielens
from genrec.demo.evaluate import two_orders, user_request
from genrec.demo.factors import svd_factors
from genrec.demo.model_dir import read_titles
from genrec.engine import Engine

SLICE = DemoConfig(
    users=24,
    max_steps=3,
    batch=8,
    history=10,
    hidden=32,
    heads=2,
    kv_heads=1,
    head_dim=16,
    intermediate=64,
    codebook=16,
    rank=8,
    negatives=2,
    seed=3,
)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    lines = []
    report = run_demo(out, out / "model", SLICE, beam=12, progress=False, say=lines.append)
    return out, report, lines


def test_demo_trains_writes_a_loadable_model_and_measures_it(demo_run):
    out, report, lines = demo_run
    assert report["seed"] == 3 and report["users"] == 24 and not report["model_reused"]
    assert report["training"]["steps"] == 3
    assert set(report["quality@10"]) == {"retrieve", "recommend", "popularity"}
    for row in report["quality@10"].values():
        assert 0 <= row["ndcg@10"] <= row["recall@10"] <= 1
    assert (out / "recall_at_k.png").stat().st_size > 10_000
    assert json.loads((out / "metrics.json").read_text())["quality@10"] == report["quality@10"]
    assert any(line.startswith("method") for line in lines)
    model_dir = out / "model"
    engine = Engine.from_pretrained(model_dir)  # the user-facing path
    assert len(engine.catalog) == 1682 and engine.projector.user_dim == 8
    assert read_titles(model_dir)["1"] == "Toy Story (1995)"
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)  # a standard directory
    assert hf.config.model_type == "qwen3"


def test_a_rerun_reuses_the_model_unless_asked_to_retrain(demo_run):
    out, first, _ = demo_run
    weights = (out / "model" / "model.safetensors").stat().st_mtime_ns
    again = run_demo(out, out / "model", SLICE, beam=12, progress=False, say=lambda _: None)
    assert again["model_reused"] and again["quality@10"] == first["quality@10"]
    assert (out / "model" / "model.safetensors").stat().st_mtime_ns == weights
    retrained = run_demo(out, out / "model", SLICE, retrain=True, beam=12, progress=False, say=lambda _: None)
    assert not retrained["model_reused"]
    assert retrained["quality@10"] == first["quality@10"]  # same seed, same steps: the same model


def test_retrieve_order_from_a_recommend_equals_engine_retrieve(demo_run):
    """The evaluation reads both orders off one recommend; retrieve's must be what Engine.retrieve returns."""
    out, _, _ = demo_run
    engine = Engine.from_pretrained(out / "model")
    data = load_movielens().head(SLICE.users)
    users = svd_factors(data, SLICE.rank).users
    requests = [user_request(engine, data, users, u, SLICE.history, beam=12) for u in range(6)]
    retrieved = engine.retrieve([RetrieveRequest(**r.model_dump(exclude={"candidates", "labels"})) for r in requests])
    for request, result, beams in zip(requests, engine.recommend(requests), retrieved, strict=True):
        retrieve_order, recommend_order = two_orders(result)
        assert retrieve_order == [item.item_id for item in beams.items]
        assert sorted(recommend_order) == sorted(retrieve_order)
        assert not set(recommend_order) & set(request.exclude_item_ids)
