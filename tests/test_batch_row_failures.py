"""One row can fail only itself (issue #29, items 2, 5 and 9): a time that would overflow is an error row naming
`history[i].timestamp`; a row the engine raises on (any exception, not only a GenrecError) is an error row of the
request; in the funnel a user the ranker fails for keeps stage 1's items in beam order, marked `degraded` and
counted; every other user's results are written and the job's error fraction decides its exit. A users input
with columns no stage reads gets one warning line naming them."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from genrec.api import RankedItem, RankRequest, RankResult, RetrieveRequest
from genrec.batch import Execution, FunnelSpec, RankingExecution, RankSpec, RecommendSpec, run
from genrec.batch.output import RANKINGS, RECOMMENDATIONS, OutputDir
from genrec.batch.shards import UsersInput
from genrec.batch.spec import FORMAT, FUNNEL_FORMAT
from genrec.batch.stages import BeamOrder, Rank, RankRetrieved, Recommend, Retrieve
from genrec.batch.tables import ROW, Degraded, Versions, funnel_table, recommendations_table
from genrec.batch.worker import ShardWorker
from genrec.errors import GenrecError
from tests import rank_inputs
from tests.conftest import HSTU_TINY, random_prompt
from tests.faulty_engine import FAILS_PROMPT_TOKENS, FAILS_TO_PREPARE, FAILS_TO_RUN, FaultyWorker, inject_faults
from tests.shard_runs import error_rows, run_shard

REPO = Path(__file__).resolve().parents[1]
OVERFLOWING = [{"item_id": "item-000001", "timestamp": -1.7e308}, {"item_id": "item-000002", "timestamp": 1.7e308}]


# -- the rank job, in process -----------------------------------------------------------------------------------


def test_a_rank_row_that_overflows_or_makes_the_engine_raise_is_its_own_error_row(tmp_path):
    hstu_dir = rank_inputs.model_dir(tmp_path)
    rows = rank_inputs.users_rows(6, seed=8)
    rows[1]["history"] = OVERFLOWING
    rows[2]["history"] = [*rows[2]["history"], {"item_id": "item-000003", "timestamp": 2e12}]  # epoch ms
    rows[3]["history"] = [*rows[3]["history"], {"item_id": "item-000059"}]
    rows[4]["history"] = [{"item_id": "item-000058"}, *rows[4]["history"]]
    rank_inputs.write_users(tmp_path / "users.parquet", rows)
    spec = RankSpec(model=str(hstu_dir), users=str(tmp_path / "users.parquet"), out=str(tmp_path / "out"))
    (shard,) = UsersInput(spec.users, Rank.layout).shards(spec.batch_size)
    OutputDir(spec.out, RANKINGS).open_run({})
    worker = ShardWorker(Rank(spec), run_id="r")
    good = [RankRequest(history=rows[i]["history"], candidates=rows[i]["candidates"]) for i in (0, 5)]
    assert not {"item-000058", "item-000059"} & {e.item_id for r in good for e in r.history}  # the faults hit 3, 4
    reference = worker.engine.rank(good)  # before the faults: the plain engine
    inject_faults(worker.engine, fails_to_run="item-000059", fails_to_prepare="item-000058")
    report = run_shard(worker, shard)

    assert error_rows(spec.out, shard) == [
        (1, "history[0].timestamp", "user-001"),
        (2, f"history[{len(rows[2]['history']) - 1}].timestamp", "user-002"),
        (3, "request", "user-003"),
        (4, "request", "user-004"),
    ]
    reasons = pq.read_table(Path(spec.out) / "errors" / shard.name).column("reason").to_pylist()
    assert "seconds" in reasons[0] and "milliseconds" in reasons[1]
    assert reasons[2:] == [
        "internal error (RuntimeError: injected: prefilling this context)",
        "internal error (ZeroDivisionError: injected: preparing this history)",
    ]
    output = pq.read_table(Path(spec.out) / RANKINGS / shard.name).to_pylist()
    assert sorted({r["user_id"] for r in output}) == ["user-000", "user-005"]
    for user, want in zip(("user-000", "user-005"), reference, strict=True):
        got = [r for r in output if r["user_id"] == user]
        assert [r["item_id"] for r in got] == [i.item_id for i in want.items]
        for row, item in zip(got, want.items, strict=True):
            assert [row[f"prob_{t}"] for t in item.scores] == pytest.approx(list(item.scores.values()), abs=1e-6)
    assert (report["errors"], report["degraded"]) == (4, 0)


# -- the funnel through Ray Data ------------------------------------------------------------------------------

USERS, BATCH, BEAM, RESULTS, TASK = 9, 3, 8, 6, "like"
EVENT = pa.struct([("item_id", pa.string()), ("action", pa.int64()), ("timestamp", pa.float64())])
SCHEMA = pa.schema(
    [
        ("user_id", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int64())),
        ("history", pa.list_(EVENT)),
        ("notes", pa.string()),  # read by no stage: warned of
    ]
)
ERRORS = {1: "history[0].timestamp", 7: "request"}  # an overflowing history; a prompt the retriever raises on
DEGRADED = {4: "RuntimeError: injected: prefilling", 5: "ZeroDivisionError: injected: preparing"}


def funnel_users(engine, path: Path) -> list[dict]:
    gen, rng = torch.Generator().manual_seed(29), random.Random(29)
    rows = []
    for i in range(USERS):
        t, history = 1.7e9, []
        for _ in range(3 + i):
            t += rng.choice([5.0, 300.0, 86400.0])
            history.append({"item_id": f"item-{rng.randrange(HSTU_TINY.items - 2):06d}", "action": 0, "timestamp": t})
        prompt = random_prompt(engine, 20 + i, gen)
        rows.append({"user_id": f"u{i}", "prompt_token_ids": prompt, "history": history, "notes": "vip"})
    rows[1]["history"] = OVERFLOWING
    rows[4]["history"].append({"item_id": FAILS_TO_RUN, "action": 1, "timestamp": 1.8e9})
    rows[5]["history"].insert(0, {"item_id": FAILS_TO_PREPARE, "action": 1, "timestamp": 1.6e9})
    rows[7]["prompt_token_ids"] = rows[7]["prompt_token_ids"][:FAILS_PROMPT_TOKENS]
    pq.write_table(pa.Table.from_pylist(rows, SCHEMA), path)
    return rows


def in_process(spec: FunnelSpec) -> list[dict]:
    """The funnel's output by plain workers called in process, shard by shard: what the job writes without faults."""
    shards = UsersInput(spec.users, BeamOrder.layout).shards(spec.batch_size)
    OutputDir(spec.out, RECOMMENDATIONS).open_run({})
    first, second = ShardWorker(BeamOrder(spec), "r", hand_on=True), ShardWorker(RankRetrieved(spec), "r")
    second(first(pa.Table.from_pylist([s.as_row() for s in shards])))
    return pq.read_table(Path(spec.out) / RECOMMENDATIONS).to_pylist()


def test_the_funnel_writes_every_other_user_degrades_ranker_failures_and_exits_by_the_error_fraction(
    ray_cluster, engine, tiny_dir, hstu_dir, tmp_path, capfd
):
    rows = funnel_users(engine, tmp_path / "users.parquet")
    settings = dict(beam_width=BEAM, num_results=RESULTS, batch_size=BATCH, rank_task=TASK)
    spec = FunnelSpec(
        model=str(tiny_dir), ranker=str(hstu_dir), users=str(tmp_path / "users.parquet"), out=str(tmp_path / "out"),
        **settings,
    )  # fmt: skip
    ranking = RankingExecution(rank_actors=1, rank_cpus_per_actor=0.5)
    summary = run(spec, Execution(progress=False), ranking, worker=FaultyWorker)
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "column(s) notes" in warnings[0], warnings

    errors = pq.read_table(Path(spec.out) / "errors").to_pylist()
    assert [(e["row"], e["field"], e["user_id"]) for e in errors] == [(r, f, f"u{r}") for r, f in ERRORS.items()]
    assert "RuntimeError: injected" in errors[1]["reason"]
    got = pq.read_table(Path(spec.out) / RECOMMENDATIONS).to_pylist()
    plain = in_process(spec.model_copy(update={"out": str(tmp_path / "plain")}))
    assert {r["user_id"] for r in got} == {f"u{i}" for i in range(USERS) if i not in ERRORS}
    assert {r["user_id"] for r in plain} == {f"u{i}" for i in range(USERS) if i != 1}  # u7's error was the fault's
    for i in sorted(set(range(USERS)) - ERRORS.keys()):
        user = f"u{i}"
        mine, want = [r for r in got if r["user_id"] == user], [r for r in plain if r["user_id"] == user]
        if i in DEGRADED:  # stage 1's first items in beam order, no probabilities, marked
            asked = RetrieveRequest(prompt_token_ids=rows[i]["prompt_token_ids"], beam_width=BEAM, num_results=RESULTS)
            want = [{"item_id": item.item_id} for item in engine.retrieve([asked])[0].items]
            assert [(r["rank"], r["retrieval_rank"]) for r in mine] == [(k, k) for k in range(1, RESULTS + 1)]
            assert all(r["prob_like"] is None and r["degraded"] for r in mine)
            assert {r["degraded_reason"] for r in mine} == {f"ranker_error: internal error ({DEGRADED[i]} " + (
                "this context)" if i == 4 else "this history)")}  # fmt: skip
        else:
            assert all(not r["degraded"] and r["degraded_reason"] is None for r in mine)
        assert [r["item_id"] for r in mine] == [r["item_id"] for r in want]
        if i not in DEGRADED:
            for mine_row, want_row in zip(mine, want, strict=True):
                assert mine_row["prob_like"] == pytest.approx(want_row["prob_like"], abs=1e-6)
    assert not any(r["degraded"] for r in plain) and len(got) == (USERS - len(ERRORS)) * RESULTS

    assert (summary.errors, summary.degraded_users, summary.rows_written) == (len(ERRORS), len(DEGRADED), len(got))
    assert summary.error_fraction == pytest.approx(len(ERRORS) / USERS)
    assert summary.failed(0.01) and not summary.failed(0.25)  # the job's exit: 1, or 0 with --max-error-fraction
    again = run(spec, Execution(progress=False), ranking)  # all committed: the counts come from the files
    assert (again.processed, again.errors, again.degraded_users) == (0, len(ERRORS), len(DEGRADED))


def test_the_rank_job_writes_every_other_user_and_exits_by_the_error_fraction(ray_cluster, tmp_path):
    hstu_dir = rank_inputs.model_dir(tmp_path)
    rows = rank_inputs.users_rows(8, seed=9)
    rows[2]["history"] = OVERFLOWING
    rows[5]["history"] = [{"item_id": "item-000004", "timestamp": -2e12}]
    users = tmp_path / "users.parquet"
    table = pa.Table.from_pylist(rows, rank_inputs.schema())
    pq.write_table(table.append_column("country", pa.array(["nl"] * len(rows))), users)
    env = {
        **os.environ,
        "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address,  # the session cluster, as a second driver
        "RAY_AUTH_MODE": "disabled",
        "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
    }
    job = [sys.executable, str(REPO / "jobs" / "batch_rank.py"), "--model", str(hstu_dir), "--users", str(users)]
    job += ["--out", str(tmp_path / "out"), "--batch-size", "3", "--no-progress"]
    done = subprocess.run(job, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]  # 2 bad rows of 8 pass the default 1 %: no traceback
    assert "Traceback" not in done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].endswith("column(s) country"), warnings
    summary = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("batch summary: "))[15:])
    assert (summary["processed"], summary["errors"], summary["degraded_users"]) == (8, 2, None)
    errors = pq.read_table(tmp_path / "out" / "errors").to_pylist()
    assert [(e["row"], e["field"]) for e in errors] == [(2, "history[0].timestamp"), (5, "history[0].timestamp")]
    ranked = pq.read_table(tmp_path / "out" / RANKINGS)
    assert set(ranked.column("user_id").to_pylist()) == {r["user_id"] for k, r in enumerate(rows) if k not in (2, 5)}
    again = subprocess.run([*job, "--max-error-fraction", "0.3"], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]  # the rerun: nothing to do, and within the fraction


# -- pieces -----------------------------------------------------------------------------------------------------


def test_the_funnel_table_keeps_a_degraded_users_stage_1_order_and_marks_it():
    stage1 = recommendations_table(
        pa.array(["a", "b"]),
        [0, 1],
        [_retrieved(["x", "y", "z"]), _retrieved(["v", "w"])],
        False,
        Versions("m", "c"),
        "r",
    )
    stage1 = stage1.append_column(ROW, pa.array([0, 0, 0, 1, 1], pa.int64()))
    ranked = RankResult(items=[RankedItem(item_id=i, scores={"like": p}) for i, p in (("x", 0.1), ("z", 0.9))],
                        history_events=1)  # fmt: skip
    table = funnel_table(stage1, {0: ranked, 1: Degraded("ranker_error: boom")}, ("like",), "like", "rv")
    got = [(r["user_id"], r["rank"], r["item_id"], r["prob_like"], r["degraded"], r["degraded_reason"])
           for r in table.to_pylist()]  # fmt: skip
    assert got == [
        ("a", 1, "z", 0.9, False, None), ("a", 2, "x", 0.1, False, None), ("a", 3, "y", None, False, None),
        ("b", 1, "v", None, True, "ranker_error: boom"), ("b", 2, "w", None, True, "ranker_error: boom"),
    ]  # fmt: skip
    assert table.schema.field("degraded").type == pa.bool_() and table.column("degraded").null_count == 0


def _retrieved(item_ids: list[str]):
    from genrec.api import RetrievedItem, RetrieveResult

    items = [RetrievedItem(item_id=i, semantic_id=[1, 2], logprob=-k) for k, i in enumerate(item_ids)]
    return RetrieveResult(items=items, prompt_tokens=1)


def test_the_columns_no_stage_reads_are_named(tmp_path):
    users = tmp_path / "users.parquet"
    pq.write_table(pa.table({"country": ["nl"], "user_id": ["a"], "prompt": ["hi"], "candidates": [["i"]]}), users)
    assert UsersInput(str(users), Retrieve.layout).unread == ["country", "candidates"]  # no scoring: no candidates
    assert UsersInput(str(users), Recommend.layout).unread == ["country"]
    spec = RecommendSpec(model="m", users=str(users), out="o", score=True)
    assert Recommend(spec).layout.columns(["user_id", "prompt", "candidates"]) == ["user_id", "prompt", "candidates"]


def test_the_funnel_output_format_moved_on_alone(tiny_dir, hstu_dir, tmp_path):
    """The funnel's output gained its degraded columns: an older funnel's directory is another run's; the other
    jobs' output did not change, nor their format."""
    funnel = FunnelSpec(model=str(tiny_dir), ranker=str(hstu_dir), users="u", out="o").identity("v", "in")
    older = {**funnel, "format": FORMAT}
    OutputDir(str(tmp_path), RECOMMENDATIONS).open_run(older)
    with pytest.raises(GenrecError, match=f"another run .*format: {FORMAT} -> {FUNNEL_FORMAT}"):
        OutputDir(str(tmp_path), RECOMMENDATIONS).open_run(funnel)
    assert FUNNEL_FORMAT > FORMAT == RecommendSpec(model="m", users="u", out="o").identity("v", "in")["format"]
    assert RankSpec(model="m", users="u", out="o").identity("v", "in")["format"] == FORMAT
