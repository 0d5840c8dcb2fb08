"""Batch recommendation on Ray Data: equal to the engine called directly, resumable after the driver is
killed (byte-identical output, nothing committed redone), bad rows in errors/, user embeddings from the cache."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from genrec.api import RecommendRequest, RetrieveRequest
from genrec.batch import CacheConfig, Execution, RecommendSpec, load_user_embeddings, run
from genrec.batch.output import STALE_TMP_AGE_S, OutputDir
from genrec.catalog.catalog import catalog_version
from genrec.model.directory import model_version
from tests.conftest import random_prompt

REPO = Path(__file__).resolve().parents[1]
USERS, BATCH, BEAM, RESULTS = 64, 2, 8, 4
BAD = {5: "prompt_token_ids", 11: "user_id"}  # row -> the field its error names
SCHEMA = pa.schema([("user_id", pa.string()), ("prompt", pa.string()), ("prompt_token_ids", pa.list_(pa.int64()))])


def users_rows(engine, n, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = [
        {"user_id": f"user-{i:04d}", "prompt": None, "prompt_token_ids": random_prompt(engine, 40 + i % 13, gen)}
        for i in range(n)
    ]
    rows[3] = {**rows[3], "prompt": "user listened to comedy podcasts", "prompt_token_ids": None}
    rows[5]["prompt_token_ids"] = []
    rows[11]["user_id"] = None
    return rows


@pytest.fixture(scope="module")
def users(engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("users") / "users.parquet"
    rows = users_rows(engine, USERS, seed=7)
    pq.write_table(pa.Table.from_pylist(rows, SCHEMA), path, row_group_size=25)  # some shards span two row groups
    return path, rows


def spec_for(tiny_dir, users_path, out, **overrides):
    settings = dict(beam_width=BEAM, num_results=RESULTS, batch_size=BATCH)
    return RecommendSpec(model=str(tiny_dir), users=str(users_path), out=str(out), **{**settings, **overrides})


@pytest.fixture(scope="module")
def reference(ray_cluster, tiny_dir, users, tmp_path_factory):
    """One uninterrupted run: the output every other run of the same spec must equal."""
    spec = spec_for(tiny_dir, users[0], tmp_path_factory.mktemp("reference") / "out")
    return spec, run(spec, Execution(progress=False))


def part_files(out, kind="recommendations"):
    return sorted(p for p in (Path(out) / kind).iterdir() if not p.name.startswith("."))


def read_output(out, kind="recommendations"):
    return pa.concat_tables([pq.read_table(p) for p in part_files(out, kind)])


def test_output_equals_the_engine_called_directly(reference, users, engine, tiny_dir):
    spec, summary = reference
    rows = users[1]
    table = read_output(spec.out).to_pylist()
    assert summary.users == USERS and summary.processed == USERS and summary.skipped_as_done == 0
    assert summary.errors == len(BAD) and summary.rows_written == len(table) == (USERS - len(BAD)) * RESULTS
    assert {r["model_version"] for r in table} == {model_version(tiny_dir)} == {summary.model_version}
    catalog = catalog_version(tiny_dir / "genrec/catalog.parquet")
    assert {r["catalog_version"] for r in table} == {catalog} == {summary.catalog_version}
    assert {r["run_id"] for r in table} == {summary.run_id}
    assert len({(r["user_id"], r["rank"]) for r in table}) == len(table)  # no duplicates

    expected = []
    for start in range(0, USERS, BATCH):  # the shards, each one engine call over its valid rows
        good = [r for i, r in enumerate(rows[start : start + BATCH], start) if i not in BAD]
        requests = [
            RetrieveRequest(
                prompt=r["prompt"], prompt_token_ids=r["prompt_token_ids"], beam_width=BEAM, num_results=RESULTS
            )
            for r in good
        ]
        results = engine.retrieve(requests) if requests else []
        for row, result in zip(good, results, strict=True):
            expected += [(row["user_id"], rank, item) for rank, item in enumerate(result.items, 1)]
    assert [(r["user_id"], r["rank"], r["item_id"]) for r in table] == [(u, k, i.item_id) for u, k, i in expected]
    assert [r["semantic_id"] for r in table] == [i.semantic_id for _, _, i in expected]
    assert np.allclose([r["retrieval_logprob"] for r in table], [i.logprob for _, _, i in expected], atol=1e-5)
    assert all(r["score"] is None for r in table)


def test_bad_rows_go_to_errors_with_the_field(reference):
    spec, _ = reference
    errors = read_output(spec.out, "errors").to_pylist()
    assert [(e["row"], e["field"]) for e in errors] == sorted(BAD.items())
    assert errors[0]["user_id"] == "user-0005" and "empty" in errors[0]["reason"]
    assert errors[1]["user_id"] is None and errors[1]["reason"] == "is null"


def committed(out) -> int:
    directory = Path(out) / "recommendations"
    return len([p for p in directory.glob("part-*.parquet")]) if directory.exists() else 0


def test_driver_killed_midway_then_rerun_equals_an_uninterrupted_run(ray_cluster, reference, tmp_path):
    spec, _ = reference
    out = tmp_path / "out"
    env = {
        **os.environ,
        "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address,  # the session cluster, as a second driver
        "RAY_AUTH_MODE": "disabled",
        "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
    }
    job = [sys.executable, str(REPO / "jobs" / "batch_recommend.py"), "--model", spec.model, "--users", spec.users]
    job += ["--out", str(out), "--beam-width", str(BEAM), "--num-results", str(RESULTS), "--batch-size", str(BATCH)]
    job += ["--no-progress"]
    shards = USERS // BATCH

    driver = subprocess.Popen(job, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while committed(out) < shards // 4:
        assert driver.poll() is None, "the driver ended before it could be killed"
        assert time.monotonic() < deadline, "no shard was committed in time"
        time.sleep(0.02)
    driver.send_signal(signal.SIGKILL)  # the driver itself: Ray then ends its actors
    driver.wait()
    at_kill = committed(out)
    assert at_kill < shards, "the run finished before the kill: nothing was left to resume"

    # The rerun (default --max-error-fraction 0.01 < 2 bad rows of 64) finishes the run and exits 1.
    rerun = subprocess.run(job, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in rerun.stdout.splitlines() if line.startswith("batch summary: ")]
    assert rerun.returncode == 1, rerun.stderr[-3000:]
    summary = json.loads(lines[-1].removeprefix("batch summary: "))
    assert summary["skipped_as_done"] >= at_kill * BATCH  # nothing committed was redone ...
    assert summary["skipped_as_done"] + summary["processed"] == USERS  # ... and nothing is missing
    print(f"\nkilled with {at_kill}/{shards} shards committed; the rerun computed {summary['processed']} users")

    for kind in ("recommendations", "errors"):  # byte-identical files: no duplicates, no gaps
        resumed, uninterrupted = part_files(out, kind), part_files(spec.out, kind)
        assert [p.name for p in resumed] == [p.name for p in uninterrupted]
        assert all(a.read_bytes() == b.read_bytes() for a, b in zip(resumed, uninterrupted, strict=True))
    # A writer killed mid-file leaves its temporary: a run started within STALE_TMP_AGE_S leaves it (it could be a
    # live run's, being written); once older, the next run's clean-up removes it. Nothing else is left behind.
    left = [p for p in out.rglob(".*") if p.is_file()]
    assert all(p.name.endswith(".tmp") and p.parent.name in ("recommendations", "errors") for p in left), left
    for p in left:
        os.utime(p, (time.time() - STALE_TMP_AGE_S - 1,) * 2)
    assert OutputDir(str(out), "recommendations").remove_stale_tmp() == len(left)
    assert not [p for p in out.rglob(".*") if p.is_file()], "temporary files left behind"

    again = subprocess.run([*job, "--max-error-fraction", "0.05"], env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert '"processed": 0' in again.stdout and f'"skipped_as_done": {USERS}' in again.stdout


def test_recommend_with_embeddings_from_the_cache(ray_cluster, engine, tiny_dir, tmp_path):
    """--score --order-by joint with given candidates; embeddings bulk-loaded into the cache (durable store) and
    looked up by user."""
    import ray

    from genrec.cache import SQLiteStore
    from genrec.cache.actor import EmbeddingCache
    from genrec.model.tokenizer import USER_TOKEN

    placeholder = engine.family.tokenizer.convert_tokens_to_ids(USER_TOKEN)
    gen = torch.Generator().manual_seed(3)
    n, dim = 6, engine.family.projector.user_dim
    vectors = torch.randn(n, dim, generator=gen).tolist()
    prompts = [[placeholder, *random_prompt(engine, 20, gen)] for _ in range(n)]
    candidates = [["item-000001", "item-000002"]] * n
    pq.write_table(pa.table({"user_id": list(range(n)), "prompt_token_ids": prompts, "candidates": candidates}),
                   tmp_path / "users.parquet")  # fmt: skip
    pq.write_table(pa.table({"user_id": list(range(n - 1)), "embedding": vectors[: n - 1]}), tmp_path / "emb.parquet")

    cache = CacheConfig(name="batch-test-cache", store_path=str(tmp_path / "emb.sqlite"))
    loaded = load_user_embeddings(str(tmp_path / "emb.parquet"), cache)
    assert loaded["loaded"] == loaded["resident"] == n - 1
    assert SQLiteStore(tmp_path / "emb.sqlite", dim).count() == n - 1  # durable before the job uses it
    try:
        spec = spec_for(
            tiny_dir,
            tmp_path / "users.parquet",
            tmp_path / "out",
            score=True,
            order_by="joint",
            score_weight=0.5,
            batch_size=3,
            cache=cache,
        )
        summary = run(spec, Execution(progress=False))
    finally:
        for actor in EmbeddingCache.connect(cache.with_dim(dim)).actors:
            ray.kill(actor)
    assert summary.errors == 1  # the last user has no embedding anywhere
    (error,) = read_output(spec.out, "errors").to_pylist()
    assert (error["user_id"], error["field"]) == (n - 1, "user_embedding")

    table = read_output(spec.out).to_pylist()
    expected = []
    for start in (0, 3):
        users = [u for u in range(start, start + 3) if u < n - 1]
        requests = [
            RecommendRequest(
                prompt_token_ids=prompts[u],
                user_embedding=vectors[u],
                candidates=[{"item_id": c} for c in candidates[u]],
                beam_width=BEAM,
                num_results=RESULTS,
                rank_by="joint",
                score_weight=0.5,
            )
            for u in users
        ]
        for u, result in zip(users, engine.recommend(requests), strict=True):
            expected += [(u, rank, item) for rank, item in enumerate(result.items, 1)]
    assert [(r["user_id"], r["rank"], r["item_id"]) for r in table] == [(u, k, i.item_id) for u, k, i in expected]
    assert np.allclose([r["score"] for r in table], [i.score_logprob for _, _, i in expected], atol=1e-5)
    assert np.allclose([r["code_logprob"] for r in table], [i.code_logprob for _, _, i in expected], atol=1e-5)
    given = [r for r in table if r["retrieval_logprob"] is None]
    assert len(given) == 2 * (n - 1) and {r["item_id"] for r in given} == {"item-000001", "item-000002"}


def test_a_pipeline_of_the_callers_own_with_a_genrec_stage_gives_the_jobs_rows(reference, users, tmp_path):
    """genrec.data in a pipeline the job does not know (examples/ray_data_pipeline.py's): rows from Python objects,
    the genrec stage, the caller's own map_batches, written elsewhere. The job's rows for the same users; each bad
    row a row with its error."""
    import importlib.util

    import ray

    path = REPO / "examples" / "ray_data_pipeline.py"
    example = importlib.util.module_from_spec(spec := importlib.util.spec_from_file_location("example", path))
    spec.loader.exec_module(example)
    job_spec, summary = reference
    settings = dict(beam_width=BEAM, num_results=RESULTS, batch_size=BATCH)
    example.recommendations(ray.data.from_items(users[1]), job_spec.model, **settings).write_parquet(str(tmp_path))
    mine = pq.read_table(tmp_path).to_pylist()
    assert len({r["made_at"] for r in mine}) == 1  # the caller's own map ran after the stage

    job = sorted(read_output(job_spec.out).to_pylist(), key=lambda r: (r["user_id"], r["rank"]))
    good = sorted((r for r in mine if r["error_reason"] is None), key=lambda r: (r["user_id"], r["rank"]))
    same = ("user_id", "rank", "item_id", "semantic_id", "model_version", "catalog_version")
    assert [[r[c] for c in same] for r in good] == [[r[c] for c in same] for r in job]
    logprobs = [[r["retrieval_logprob"] for r in rows] for rows in (good, job)]
    assert np.allclose(*logprobs, atol=1e-5)
    assert {r["run_id"] for r in good} != {summary.run_id} and len({r["run_id"] for r in good}) == 1  # its own

    bad = sorted(((r["user_id"], r["error_field"]) for r in mine if r["error_reason"] is not None), key=str)
    assert bad == sorted(((users[1][row]["user_id"], field) for row, field in BAD.items()), key=str)
    assert all(r["item_id"] is None for r in mine if r["error_reason"] is not None)
