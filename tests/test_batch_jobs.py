"""The jobs as a cluster runs them: semantic IDs through Ray Data, and real `ray job submit`s of the batch jobs
(recommend, rank) against a `ray start --head` cluster that this test starts (and stops) on ports and a temp dir
of its own (tests/dashboard_cluster.py)."""

import json
import shlex
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from genrec.batch.semantic_ids import build_semantic_ids, fixed_size_block
from genrec.catalog import Catalog
from genrec.catalog_tools.build_ids import build_catalog_and_codebooks
from genrec.model.sid_layout import SidLayout
from genrec.model.tokenizer import load_tokenizer
from tests import rank_inputs
from tests.dashboard_cluster import dashboard_cluster, job_submit

REPO = Path(__file__).resolve().parents[1]


def test_semantic_ids_through_ray_data_equal_build_ids(ray_cluster, tiny_dir, tmp_path):
    vectors = np.random.default_rng(4).normal(size=(300, 12)).astype(np.float32)
    items = [f"item-{i:06d}" for i in range(300)]
    whole = pa.table({"item_id": items, "embedding": vectors.tolist()})
    (tmp_path / "items").mkdir()
    for part, (start, stop) in enumerate([(0, 120), (120, 300)]):  # a directory of files, read in name order
        pq.write_table(whole.slice(start, stop - start), tmp_path / "items" / f"part-{part}.parquet")
    pq.write_table(whole, tmp_path / "whole.parquet")

    report = build_semantic_ids(str(tmp_path / "items"), str(tiny_dir), str(tmp_path / "catalog.parquet"), iters=5)
    assert report["items"] == 300 and report["dim"] == 12
    layout = SidLayout.infer(load_tokenizer(tiny_dir))
    built = Catalog.load(tmp_path / "catalog.parquet", layout)
    # what `genrec build-ids` computes:
    reference, _ = build_catalog_and_codebooks(tmp_path / "whole.parquet", layout, iters=5)
    assert built.item_ids.tolist() == reference.item_ids.tolist()
    assert np.array_equal(built.codes, reference.codes)


@pytest.mark.parametrize("bad", [[1.0], None, []])
def test_a_bad_embedding_block_names_its_item(bad):
    block = fixed_size_block(pa.table({"item_id": ["a", "b"], "embedding": [[1.0, 2.0], bad]}))
    (problem,) = block.column("problem").to_pylist()  # the driver raises it as one GenrecError
    assert problem.startswith("item 'b' has a null, empty or differently sized embedding")


@pytest.mark.timeout(1200)  # a `ray start` cluster, then two jobs in one submission (600 s bound: CI-like load)
def test_ray_job_submit_runs_the_batch_jobs(tiny_dir, tmp_path):
    users = tmp_path / "users.parquet"
    pq.write_table(
        pa.table({"user_id": list(range(6)), "prompt": [f"user {i} likes podcasts" for i in range(6)]}), users
    )
    hstu, ranked = rank_inputs.model_dir(tmp_path), tmp_path / "rank-users.parquet"
    rows = rank_inputs.users_rows(5, seed=3)
    rank_inputs.write_users(ranked, rows)

    def job(script: str, *flags: str) -> list[str]:
        return [sys.executable, f"jobs/{script}", *flags, "--batch-size", "4", "--no-progress"]

    recommend = ["--model", str(tiny_dir), "--users", str(users), "--out", str(tmp_path / "out"), "--beam-width", "4"]
    rank = ["--model", str(hstu), "--users", str(ranked), "--out", str(tmp_path / "ranked"), "--rank-by", "click"]
    # One submission whose entrypoint (a shell line) runs both job scripts, each its own driver on the cluster, the
    # second only when the first exits 0: a `ray job submit` costs ~10 s of its own here (runtime env, supervisor).
    with dashboard_cluster() as (address, env):
        both = f"{shlex.join(job('batch_recommend.py', *recommend))} && {shlex.join(job('batch_rank.py', *rank))}"
        done = job_submit(address, env, ["sh", "-c", both], REPO)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    lines = [x.removeprefix("batch summary: ") for x in done.stdout.splitlines() if x.startswith("batch summary: ")]
    summaries = [json.loads(x) for x in lines]
    assert len(summaries) == 2, done.stdout[-4000:]

    summary = summaries[0]  # batch_recommend.py's
    assert (summary["users"], summary["processed"], summary["errors"]) == (6, 6, 0)
    output = pq.read_table(tmp_path / "out" / "recommendations")
    assert output.num_rows == summary["rows_written"] == 6 * 4

    summary = summaries[1]  # batch_rank.py's
    assert (summary["users"], summary["processed"], summary["errors"]) == (5, 5, 0)
    output = pq.read_table(tmp_path / "ranked" / "rankings")
    assert output.num_rows == summary["rows_written"] == sum(len(r["candidates"]) for r in rows)
