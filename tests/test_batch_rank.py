"""The batch rank job: rows of (history, candidates) ranked by an HSTU model from Parquet to Parquet. In-process
(no Ray): every kind of bad row becomes an error naming its field, the output table's order and task columns,
the job's one-line refusals. Through the session's Ray: equal to Engine.rank on the same rows, and a deleted
shard's output reproduced byte for byte by a rerun of the job."""

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from genrec.api import RankedItem, RankRequest, RankResult
from genrec.batch import Execution, RankSpec, RecommendSpec, run
from genrec.batch.output import RANKINGS, RECOMMENDATIONS, OutputDir
from genrec.batch.stages import Rank
from genrec.batch.tables import Versions, rankings_table
from genrec.engine import Engine, SchedulerConfig
from genrec.errors import GenrecError
from tests import rank_inputs
from tests.rank_inputs import SPEC, users_rows, write_users
from tests.shard_runs import error_rows, run_in_process, run_shard
from tests.test_http_errors import PYDANTIC_WORDS

REPO = Path(__file__).resolve().parents[1]
TASKS = SPEC.tasks


@pytest.fixture(scope="module")
def hstu_dir(tmp_path_factory):
    return rank_inputs.model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def ranker(hstu_dir):
    """The engine as the batch worker builds it: no prefix cache."""
    return Engine.from_pretrained(hstu_dir, scheduler=SchedulerConfig(prefix_cache_bytes=0))


def request_of(row: dict) -> RankRequest:
    return RankRequest(**{k: row[k] for k in ("history", "candidates", "tasks") if row.get(k) is not None})


def expected_rows(ranker, rows: list[dict], batch_size: int, rank_by: str | None, bad: set[int]) -> list[tuple]:
    """What the job must write: per shard, one Engine.rank call over its good rows; each user's items best first."""
    out = []
    for start in range(0, len(rows), batch_size):
        good = [r for i, r in enumerate(rows[start : start + batch_size], start) if i not in bad]
        results = ranker.rank([request_of(r) for r in good]) if good else []
        for row, result in zip(good, results, strict=True):
            order = sorted(range(len(result.items)), key=lambda i: -result.items[i].scores[rank_by] if rank_by else i)
            for rank, i in enumerate(order, 1):
                scores = result.items[i].scores
                out.append((row["user_id"], rank, result.items[i].item_id, *(scores.get(t) for t in TASKS)))
    return out


def written_rows(table: pa.Table, tasks: tuple[str, ...] = TASKS) -> list[tuple]:
    names = ["user_id", "rank", "item_id", *(f"prob_{t}" for t in tasks)]
    return list(zip(*(table.column(n).to_pylist() for n in names), strict=True))


def test_rankings_table_orders_by_the_task_ties_in_the_candidates_order():
    def result(*scores):
        return RankResult(items=[RankedItem(item_id=f"i{k}", scores=s) for k, s in enumerate(scores)], history_events=1)

    results = [
        result({"click": 0.2, "like": 0.9}, {"click": 0.7, "like": 0.1}, {"click": 0.2, "like": 0.5}),
        result({"click": 0.4}),  # a row whose tasks left out "like": its column is null
    ]
    user_ids = pa.array([7, 8, 9], pa.int64())
    table = rankings_table(user_ids, [0, 2], results, ("click", "like"), "click", Versions("v1", "c1"), "r1")
    assert table.column_names == [
        "user_id", "rank", "item_id", "prob_click", "prob_like", "model_version", "catalog_version", "run_id"
    ]  # fmt: skip
    assert table.schema.field("user_id").type == pa.int64() and table.schema.field("rank").type == pa.int32()
    assert written_rows(table, ("click", "like")) == [
        (7, 1, "i1", 0.7, 0.1),
        (7, 2, "i0", 0.2, 0.9),  # tied with i2 on click: the given order decides
        (7, 3, "i2", 0.2, 0.5),
        (9, 1, "i0", 0.4, None),
    ]
    given_order = rankings_table(user_ids, [0, 2], results, ("click", "like"), None, Versions("v1", "c1"), "r1")
    assert [(u, k, i) for u, k, i, *_ in written_rows(given_order, ("click", "like"))] == [
        (7, 1, "i0"),
        (7, 2, "i1"),
        (7, 3, "i2"),
        (9, 1, "i0"),
    ]
    assert set(table.column("model_version").to_pylist()) == {"v1"} and set(table.column("run_id").to_pylist()) == {
        "r1"
    }
    empty = rankings_table(pa.array([], pa.string()), [], [], ("click",), None, Versions("v1", "c1"), "r1")
    assert empty.num_rows == 0 and empty.schema.field("user_id").type == pa.string()


def test_every_kind_of_bad_rank_row_becomes_an_error_naming_its_field(ranker, hstu_dir, tmp_path):
    rng = random.Random(5)
    ok = rank_inputs.user_row(rng, None, events=4, candidates=3)
    event, history, candidates = ok["history"][0], ok["history"], ok["candidates"]
    too_many = [event] * (SPEC.max_positions + 1)
    cases = [  # (row fields, the field its error names; None: a good row)
        ({}, None),
        ({"user_id": None}, "user_id"),
        ({"history": None}, "history"),
        ({"history": []}, "history"),
        ({"history": [event, {**event, "item_id": None}]}, "history[1].item_id"),
        ({"history": [{**event, "item_id": "no-such-item"}]}, "history[0].item_id"),
        ({"history": [{**event, "action": -1}]}, "history[0].action"),
        ({"history": [{**event, "action": SPEC.actions}]}, "history[0].action"),
        ({"history": [{**event, "timestamp": math.nan}]}, "history[0].timestamp"),
        ({"history": too_many}, "history"),
        ({"candidates": None}, "candidates"),
        ({"candidates": []}, "candidates"),
        ({"candidates": [candidates[0], None]}, "candidates[1]"),
        ({"candidates": [candidates[0], "no-such-item"]}, "candidates[1]"),
        ({"tasks": ["click", "watch"]}, "tasks[1]"),
        ({"tasks": ["like"]}, "tasks"),  # --rank-by click: this row could not be ranked
        ({"tasks": ["like", "click"], "history": [{"item_id": event["item_id"]}]}, None),
    ]
    rows = [
        {"user_id": i, "history": history, "candidates": candidates, **fields} for i, (fields, _) in enumerate(cases)
    ]
    write_users(tmp_path / "users.parquet", rows, pa.int64())
    spec = RankSpec(
        model=str(hstu_dir), users=str(tmp_path / "users.parquet"), out=str(tmp_path / "out"), rank_by="click"
    )
    shard, worker, report = run_in_process(Rank(spec))

    want = [(i, field, None if i == 1 else i) for i, (_, field) in enumerate(cases) if field]
    assert error_rows(spec.out, shard) == want
    reasons = {e["row"]: e["reason"] for e in pq.read_table(tmp_path / "out" / "errors" / shard.name).to_pylist()}
    assert {row: reasons[row] for row in (2, 4, 10, 12)} == {  # a null in genrec's words (issue #46, item 6)
        2: "is required (a list of events); got null",
        4: "must be text (a string); got null",
        10: "is required (a list of strings); got null",
        12: "must be text (a string); got null",
    }
    assert not [r for r in reasons.values() if any(w in r for w in PYDANTIC_WORDS)], reasons
    output = pq.read_table(tmp_path / "out" / RANKINGS / shard.name)
    good = [i for i, (_, field) in enumerate(cases) if field is None]
    assert written_rows(output) == expected_rows(ranker, [rows[i] for i in good], len(rows), "click", set())
    assert output.column("prob_long_view").to_pylist()[-3:] == [None] * 3  # the last row asked for 2 tasks
    counts = {"rows": output.num_rows, "errors": len(want), "degraded": 0}
    assert report == {"shard": 0, "users": len(cases), **counts, "skipped": False}
    again = run_shard(worker, shard)  # a retried task: nothing recomputed
    assert again["skipped"] and again["rows"] == output.num_rows


def run_job(script: str, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    job = [sys.executable, str(REPO / "jobs" / script), *flags]
    return subprocess.run(job, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("qwen3 model", "not an HSTU ranking model"),
        ("unknown task", "error: rank_by 'watch' is not a task of the model (its tasks: click, like, long_view)"),
        ("recommend input", "needs a column 'history'"),
        ("recommend job", "an HSTU ranking model (it ranks given candidates: jobs/batch_rank.py)"),
    ],
)
def test_the_jobs_refuse_the_other_family_and_bad_arguments_in_one_line(case, fragment, hstu_dir, tiny_dir, tmp_path):
    rank_users, prompt_users = tmp_path / "rank.parquet", tmp_path / "prompts.parquet"
    write_users(rank_users, users_rows(2, seed=1))
    pq.write_table(pa.table({"user_id": ["a"], "prompt": ["hello"]}), prompt_users)
    model, users, script, flags = hstu_dir, rank_users, "batch_rank.py", []
    if case == "qwen3 model":
        model = tiny_dir
    elif case == "unknown task":
        flags = ["--rank-by", "watch"]
    elif case == "recommend input":
        users = prompt_users
    else:
        users, script = prompt_users, "batch_recommend.py"
    flags += ["--model", str(model), "--users", str(users), "--out", str(tmp_path / "out")]
    done = run_job(script, *flags, env={"RAY_ADDRESS": "127.0.0.1:1"})  # no Ray is reached: refused before
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and fragment in done.stderr, done.stderr


BATCH = 3
BAD = {4: "candidates[0]"}  # row -> the field its error names


def test_the_rank_job_equals_engine_rank_and_a_rerun_rebuilds_a_deleted_shard(ray_cluster, ranker, hstu_dir, tmp_path):
    rows = users_rows(10, seed=2)
    rows[4]["candidates"] = ["no-such-item", *rows[4]["candidates"]]
    rows[6]["tasks"] = ["long_view", "like"]
    write_users(tmp_path / "users.parquet", rows)
    spec = RankSpec(
        model=str(hstu_dir), users=str(tmp_path / "users.parquet"), out=str(tmp_path / "out"), batch_size=BATCH,
        rank_by="like",
    )  # fmt: skip
    summary = run(spec, Execution(progress=False))
    assert (summary.users, summary.shards, summary.processed, summary.errors) == (10, 4, 10, 1)
    output = pq.read_table(tmp_path / "out" / RANKINGS)
    expected = expected_rows(ranker, rows, BATCH, "like", set(BAD))
    assert summary.rows_written == output.num_rows == len(expected)
    got = written_rows(output)
    assert [r[:3] for r in got] == [r[:3] for r in expected]
    probs = [[math.nan if p is None else p for p in r[3:]] for r in got]
    want = [[math.nan if p is None else p for p in r[3:]] for r in expected]
    assert np.allclose(probs, want, atol=1e-6, equal_nan=True)
    assert set(output.column("run_id").to_pylist()) == {summary.run_id}
    assert set(output.column("model_version").to_pylist()) == {summary.model_version}
    errors = pq.read_table(tmp_path / "out" / "errors").to_pylist()
    assert [(e["row"], e["field"], e["user_id"]) for e in errors] == [(4, "candidates[0]", "user-004")]

    first = {p: p.read_bytes() for p in (tmp_path / "out").rglob("part-*.parquet")}
    for kind in (RANKINGS, "errors"):  # shard 1 (rows 3-5, the bad row among them) as if never committed
        (tmp_path / "out" / kind / "part-000001.parquet").unlink()
    env = {
        **os.environ,
        "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address,  # the session cluster, as a second driver
        "RAY_AUTH_MODE": "disabled",
        "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
    }
    flags = ["--model", spec.model, "--users", spec.users, "--out", spec.out, "--batch-size", str(BATCH)]
    rerun = run_job("batch_rank.py", *flags, "--rank-by", "like", "--no-progress", env=env)
    assert rerun.returncode == 1, rerun.stderr[-3000:]  # 1 bad row of 10 passes the default 1 %
    line = next(x for x in rerun.stdout.splitlines() if x.startswith("batch summary: "))
    again = json.loads(line.removeprefix("batch summary: "))
    assert (again["processed"], again["skipped_as_done"], again["errors"]) == (BATCH, 10 - BATCH, 1)
    assert again["run_id"] == summary.run_id and again["rows_written"] == summary.rows_written
    assert {p: p.read_bytes() for p in (tmp_path / "out").rglob("part-*.parquet")} == first

    # The same ranking as a stage of a pipeline of the caller's (genrec.data): the job's rows, its bad row a row.
    import genrec.data

    rank = genrec.data.Rank(spec.model, rank_by="like", batch_size=BATCH)
    mine = pa.Table.from_pylist(rank(ray_cluster.data.from_items(rows)).take_all())
    good = mine.filter(pc.is_null(mine["error_reason"]))
    ours, theirs = sorted(written_rows(good)), sorted(got)
    assert [r[:3] for r in ours] == [r[:3] for r in theirs]
    ours, theirs = ([[math.nan if p is None else p for p in r[3:]] for r in rows_] for rows_ in (ours, theirs))
    assert np.allclose(ours, theirs, atol=1e-6, equal_nan=True)
    assert mine.filter(pc.is_valid(mine["error_reason"])).select(["user_id", "error_field"]).to_pylist() == [
        {"user_id": "user-004", "error_field": "candidates[0]"}
    ]


def test_a_rank_run_into_a_recommend_runs_directory_is_refused(tmp_path):
    OutputDir(str(tmp_path), RECOMMENDATIONS).open_run(RecommendSpec(model="m", users="u", out="o").identity("v", "in"))
    rank = RankSpec(model="m", users="u", out="o", rank_by="click").identity("v", "in")
    with pytest.raises(GenrecError, match="another run .*job: None -> 'rank', rank_by: 'score' -> 'click'"):
        OutputDir(str(tmp_path), RANKINGS).open_run(rank)
