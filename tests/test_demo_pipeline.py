"""The demo's model step on a slice of MovieLens (few users, a few training steps), without Ray."""

import numpy as np
import pyarrow as pa
import pytest
import torch
from transformers import AutoModelForCausalLM

from genrec.api import RecommendRequest, RetrieveRequest
from genrec.engine import Engine
from genrec_demo import DemoConfig
from genrec_demo.calibrate import WEIGHTS
from genrec_demo.data import load_movielens
from genrec_demo.evaluate import measure, rankings_from_rows, retrieve_order
from genrec_demo.factors import svd_factors
from genrec_demo.model_dir import read_titles
from genrec_demo.pipeline.inputs import Prompts
from genrec_demo.pipeline.prepare import demo_factors, prepare

SLICE = DemoConfig(users=24, max_steps=3, batch=8, history=10, codebook=16, rank=8, negatives=2, near=20, seed=3)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("demo") / "model"
    lines = []
    return model_dir, prepare(model_dir, SLICE, retrain=False, say=lines.append, progress=False), lines


def test_prepare_trains_a_model_that_loads_as_genrec_and_as_transformers(prepared):
    model_dir, first, lines = prepared
    assert not first.reused and "training the demo model" in lines[0]
    assert first.recipe["training"]["steps"] == 3 and first.recipe["training"]["seed"] == 3
    engine = Engine.from_pretrained(model_dir)  # the user-facing path
    assert len(engine.catalog) == 1682 and engine.family.projector.user_dim == 8
    assert read_titles(model_dir)["1"] == "Toy Story (1995)"
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)  # a standard directory
    assert hf.config.model_type == "qwen3"


def test_the_demos_factors_do_not_depend_on_the_callers_threads():
    """Two threads change the SVD's last bits (measured: 2.5e-5), and through the semantic IDs the whole model."""
    data, before = load_movielens(), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = svd_factors(data, 32)
        torch.set_num_threads(2)
        demo = demo_factors(data, 32)
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(before)
    assert np.array_equal(demo.items, single.items) and np.array_equal(demo.users, single.users)


def test_prepare_reuses_the_model_unless_asked_to_retrain(prepared):
    model_dir, first, _ = prepared
    weights = model_dir / "model.safetensors"
    stamp, data = weights.stat().st_mtime_ns, weights.read_bytes()
    again = prepare(model_dir, SLICE, retrain=False, say=lambda _: None, progress=False)
    assert again.reused and weights.stat().st_mtime_ns == stamp
    retrained = prepare(model_dir, SLICE, retrain=True, say=lambda _: None, progress=False)
    assert not retrained.reused and weights.read_bytes() == data  # same seed, same steps: the same weights
    other = prepare(model_dir, SLICE.__class__(**{**SLICE.to_dict(), "seed": 4}), False, lambda _: None, False)
    assert not other.reused and weights.read_bytes() != data  # another recipe is never reused


def test_metrics_from_recommend_rows_equal_engine_retrieve_and_recommend(prepared):
    """Rows like the batch job's: retrieve's order read off them is what Engine.retrieve returns."""
    model_dir, first, _ = prepared
    engine = Engine.from_pretrained(model_dir)
    data, users = first.data, first.factors.users
    prompts = Prompts.of(model_dir, data, SLICE.history)
    requests = []
    for u in range(8):
        seen = data.seen_before_test(u)
        fields = {"prompt": prompts.text(seen), "user_embedding": users[u].tolist(), "beam_width": 12}
        requests.append(RecommendRequest(**fields, exclude_item_ids=[data.item_ids[i] for i in seen]))
    recommended = engine.recommend(requests)
    retrieved = engine.retrieve(
        [RetrieveRequest(**r.model_dump(include=set(RetrieveRequest.model_fields))) for r in requests]
    )
    rows = [
        {"user_id": data.user_ids[u], "rank": k + 1, "item_id": i.item_id, "retrieval_logprob": i.retrieval_logprob}
        for u, result in enumerate(recommended)
        for k, i in enumerate(result.items)
    ]
    rankings = rankings_from_rows(pa.Table.from_pylist(rows[::-1]), data, depth=12)  # any row order
    index = {item: i for i, item in enumerate(data.item_ids)}
    for u in range(8):
        items = [i.item_id for i in recommended[u].items]
        assert rankings["recommend"][u].tolist() == [index[i] for i in items]
        logprobs = [i.retrieval_logprob for i in recommended[u].items]
        assert retrieve_order(items, logprobs) == [i.item_id for i in retrieved[u].items]
        assert rankings["retrieve"][u].tolist() == [index[i.item_id] for i in retrieved[u].items]
    assert (rankings["retrieve"][8:] == -1).all()  # users without rows: nothing ranked, every one a miss
    evaluation = measure(rankings, data, depth=12)
    assert set(evaluation.ranks) == {"retrieve", "recommend", "popularity"}
    assert (evaluation.ranks["recommend"][8:] == 12).all()
    assert np.all(evaluation.recall_curve("retrieve")[-1] >= evaluation.recall_curve("retrieve")[0])


def test_recommends_ranking_is_the_best_weight_on_validation_items_and_is_kept(tmp_path):
    model_dir, lines = tmp_path / "model", []
    first = prepare(model_dir, SLICE, retrain=False, say=lines.append, progress=False)
    ranking = first.recipe["ranking"]
    assert any("choosing recommend's ranking" in line for line in lines)
    assert ranking["rank_by"] == "joint" and ranking["beam"] == 50
    recalls = ranking["validation recall@10"]
    assert set(recalls) == {str(w) for w in WEIGHTS} and recalls[str(ranking["score_weight"])] == max(recalls.values())
    # by hand for the chosen weight: each user's validation item among their top 10 by code + w * score
    engine, data = Engine.from_pretrained(model_dir), first.data
    prompts = Prompts.of(model_dir, data, SLICE.history)
    hits = 0
    for u in range(len(data.user_ids)):
        seen = data.train(u)
        request = RecommendRequest(
            prompt=prompts.text(seen),
            user_embedding=first.factors.users[u].tolist(),
            beam_width=50,
            exclude_item_ids=[data.item_ids[i] for i in seen],
            rank_by="joint",
            score_weight=ranking["score_weight"],
        )
        (result,) = engine.recommend([request])
        hits += data.item_ids[data.valid(u)] in [i.item_id for i in result.items[:10]]
    assert recalls[str(ranking["score_weight"])] == pytest.approx(hits / len(data.user_ids), abs=1e-4)
    lines.clear()
    again = prepare(model_dir, SLICE, retrain=False, say=lines.append, progress=False)
    assert again.recipe["ranking"] == ranking and not any("choosing" in line for line in lines)  # kept


def test_a_deploy_serve_gave_up_on_is_told_by_its_exception():
    """The demo waited for /healthz alone: a failed deploy (a replica's constructor raising) looked like a slow
    start until its 300 s timeout, with no reason. Serve's status now ends the wait with the exception's line."""
    from ray.serve.schema import ApplicationStatus, ApplicationStatusOverview, ServeStatus

    from genrec_demo.pipeline.cluster import deploy_failure

    def status(state: ApplicationStatus, message: str = "") -> ServeStatus:
        app = ApplicationStatusOverview(status=state, message=message, last_deployed_time_s=0.0, deployments={})
        return ServeStatus(applications={"genrec": app})

    traceback = "Deploying app 'genrec' failed with exception:\nTraceback (most recent call last):\n  File ...\n"
    failed = status(ApplicationStatus.DEPLOY_FAILED, traceback + "GenrecError: model.safetensors: truncated\n\n")
    assert deploy_failure("genrec", failed) == "GenrecError: model.safetensors: truncated"
    assert deploy_failure("genrec", status(ApplicationStatus.DEPLOY_FAILED)) == "no message"
    for state in (ApplicationStatus.DEPLOYING, ApplicationStatus.RUNNING, ApplicationStatus.UNHEALTHY):
        assert deploy_failure("genrec", status(state, "replicas starting")) is None
    assert deploy_failure("another", failed) is None
