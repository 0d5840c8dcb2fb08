"""One OpenOneRec-layout checkpoint, as downloaded plus `genrec catalog import`, served end to end (issue #30 item
8): over HTTP by the Serve app and by the batch job (chat messages, as OpenOneRec prompts), each equal to the engine
called directly."""

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from genrec.api import Candidate, RetrieveRequest, ScoreRequest
from genrec.batch import Execution, RecommendSpec, run
from genrec.catalog_tools.importers import import_catalog
from genrec.engine import Engine, SchedulerConfig
from genrec.model.directory import model_version
from genrec.testing.open_layouts import openonerec_messages, openonerec_prompt
from tests.open_checkpoints import fresh_copy
from tests.serve_apps import delete, deploy

pytestmark = pytest.mark.integration
BEAM, RESULTS = 8, 4


@pytest.fixture(scope="module")
def onerec_dir(openonerec, tmp_path_factory):
    model_dir, item_map = fresh_copy(openonerec, tmp_path_factory.mktemp("onerec-e2e"))
    import_catalog(model_dir, item_map)
    return model_dir


@pytest.fixture(scope="module")
def onerec_engine(onerec_dir):
    return Engine.from_pretrained(onerec_dir, scheduler=SchedulerConfig(prefix_cache_bytes=0))


def history(openonerec, users):
    return [openonerec.codes[str(1000 + u)] for u in users]


def test_served_over_http_equals_the_engine(serve_url, onerec_dir, onerec_engine, openonerec):
    deploy("onerec", retriever={"model_dir": str(onerec_dir)}, ingress={"limits": {"request_timeout_s": 30}})
    try:
        url = f"{serve_url}/onerec"
        messages = openonerec_messages(history(openonerec, (0, 1)))
        retrieve = RetrieveRequest(messages=messages, beam_width=BEAM, num_results=RESULTS)
        shared = next(
            item for item, code in openonerec.codes.items() if list(openonerec.codes.values()).count(code) > 1
        )
        score = ScoreRequest(messages=messages, candidates=[Candidate(item_id="1003"), Candidate(item_id=shared)])
        with httpx.Client(timeout=60) as client:
            got = client.post(f"{url}/v1/retrieve", json=retrieve.model_dump(exclude_none=True))
            assert got.status_code == 200, got.text
            assert got.headers["x-model-version"] == model_version(onerec_dir)
            (want,) = onerec_engine.retrieve([retrieve])
            body = got.json()
            assert [i["item_id"] for i in body["items"]] == [i.item_id for i in want.items]
            assert [i["logprob"] for i in body["items"]] == pytest.approx([i.logprob for i in want.items], abs=1e-4)
            assert body["codes"] == RESULTS and len(body["items"]) >= RESULTS

            scored = client.post(f"{url}/v1/score", json=score.model_dump(exclude_none=True))
            assert scored.status_code == 200, scored.text
            (want_scores,) = onerec_engine.score([score])
            got_lp = [s["logprob"] for s in scored.json()["scores"]]
            assert got_lp == pytest.approx([s.logprob for s in want_scores.scores], abs=1e-4)

            prompt = client.post(f"{url}/v1/prompt", json={"messages": messages})
            assert prompt.status_code == 200, prompt.text
            want_ids = openonerec_prompt(onerec_engine.family.tokenizer, history(openonerec, (0, 1)))[:-1]
            assert prompt.json()["token_ids"] == want_ids  # the template, thinking off; the engine appends the begin
            assert prompt.json()["begin_token_appended"] is True

            bad = client.post(f"{url}/v1/score", json={"messages": messages, "candidates": [{"item_id": "nope"}]})
            assert bad.status_code == 422 and "candidates[0].item_id" in bad.text
    finally:
        delete("onerec")


def test_the_batch_job_equals_the_engine(ray_cluster, onerec_dir, onerec_engine, openonerec, tmp_path):
    rows = [{"user_id": f"u{u}", "messages": openonerec_messages(history(openonerec, (u, u + 1)))} for u in range(6)]
    users = tmp_path / "users.parquet"
    pq.write_table(pa.Table.from_pylist(rows), users)  # messages: list<struct<role, content>>
    spec = RecommendSpec(
        model=str(onerec_dir), users=str(users), out=str(tmp_path / "out"), beam_width=BEAM, num_results=RESULTS
    )
    summary = run(spec, Execution(progress=False))
    table = pq.read_table(tmp_path / "out" / "recommendations").to_pylist()
    assert summary.errors == 0 and summary.processed == len(rows)
    results = onerec_engine.retrieve(
        [RetrieveRequest(messages=r["messages"], beam_width=BEAM, num_results=RESULTS) for r in rows]
    )
    want = [
        (r["user_id"], i.item_id, i.semantic_id, i.logprob)
        for r, res in zip(rows, results, strict=True)
        for i in res.items
    ]
    got = sorted(table, key=lambda r: (r["user_id"], r["rank"]))
    assert [(r["user_id"], r["item_id"], r["semantic_id"]) for r in got] == [w[:3] for w in want]
    assert np.allclose([r["retrieval_logprob"] for r in got], [w[3] for w in want], atol=1e-5)
    assert {r["model_version"] for r in got} == {model_version(onerec_dir)}
