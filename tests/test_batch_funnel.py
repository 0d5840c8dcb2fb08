"""The funnel (jobs/batch_recommend.py --ranker): retrieve -> rank as two Ray Data stages. Its output equals
Engine.retrieve then Engine.rank called in process on the same shards; a partial run resumes to the same
bytes; bad histories are error rows; items the ranker does not know keep stage 1's order after the ranked
ones; bad ranking flags exit 2 before any Ray work."""

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from genrec.api import Event, RankedItem, RankRequest, RankResult, RetrievedItem, RetrieveRequest, RetrieveResult
from genrec.batch import Execution, FunnelSpec, RankingExecution, RecommendSpec, run
from genrec.batch.output import RECOMMENDATIONS, OutputDir
from genrec.batch.shards import UsersInput
from genrec.batch.stages import BeamOrder, RankRetrieved, stages_of
from genrec.batch.tables import ROW, Versions, funnel_table, recommendations_table
from genrec.batch.worker import ShardWorker
from genrec.errors import GenrecError
from genrec.model.directory import model_version
from tests.conftest import HSTU_TINY, random_prompt

REPO = Path(__file__).resolve().parents[1]
USERS, BATCH, BEAM, RESULTS, TASK = 12, 3, 8, 6, "like"
# row -> the field its error names: no history; a history item the ranker does not know; an empty prompt
BAD = {2: "history", 7: "history[1].item_id", 9: "prompt_token_ids"}
EVENT = pa.struct([("item_id", pa.string()), ("action", pa.int64()), ("timestamp", pa.float64())])
SCHEMA = pa.schema([("user_id", pa.string()), ("prompt_token_ids", pa.list_(pa.int64())), ("history", pa.list_(EVENT))])


def history(rng: random.Random, events: int) -> list[dict]:
    t, out = 1.7e9, []
    for _ in range(events):
        t += rng.choice([5.0, 300.0, 86400.0])
        out.append(
            {
                "item_id": f"item-{rng.randrange(HSTU_TINY.items):06d}",
                "action": rng.choice([None, 0, 2]),
                "timestamp": t,
            }
        )
    return out


@pytest.fixture(scope="module")
def users(engine, tmp_path_factory):
    gen, rng = torch.Generator().manual_seed(3), random.Random(3)
    rows = [
        {"user_id": f"u{i:02d}", "prompt_token_ids": random_prompt(engine, 20 + i, gen), "history": history(rng, 3 + i)}
        for i in range(USERS)
    ]
    rows[2]["history"] = None
    rows[7]["history"][1]["item_id"] = "no-such-item"
    rows[9]["prompt_token_ids"] = []
    path = tmp_path_factory.mktemp("funnel-users") / "users.parquet"
    pq.write_table(pa.Table.from_pylist(rows, SCHEMA), path)
    return path, rows


def funnel_spec(tiny_dir, hstu_dir, users_path, out, **overrides) -> FunnelSpec:
    settings = dict(beam_width=BEAM, num_results=RESULTS, batch_size=BATCH, rank_task=TASK)
    return FunnelSpec(
        model=str(tiny_dir), ranker=str(hstu_dir), users=str(users_path), out=str(out), **{**settings, **overrides}
    )


@pytest.fixture(scope="module")
def reference(ray_cluster, tiny_dir, hstu_dir, users, tmp_path_factory):
    spec = funnel_spec(tiny_dir, hstu_dir, users[0], tmp_path_factory.mktemp("funnel") / "out")
    return spec, run(spec, Execution(progress=False), RankingExecution(rank_actors=1, rank_cpus_per_actor=0.5))


def expected_rows(engine, ranker, rows) -> list[tuple]:
    """Per shard: Engine.retrieve over its valid prompts (every beam), then Engine.rank over the users with a usable
    history, each user's known items ordered by the task (ties in retrieval order), then the unknown ones; the first
    RESULTS of them kept, as online."""
    out = []
    for start in range(0, USERS, BATCH):
        shard = [(i, r) for i, r in enumerate(rows[start : start + BATCH], start) if BAD.get(i) != "prompt_token_ids"]
        asked = [
            RetrieveRequest(prompt_token_ids=r["prompt_token_ids"], beam_width=BEAM, num_results=BEAM) for _, r in shard
        ]
        retrieved = engine.retrieve(asked) if asked else []
        users = [(r, res) for (i, r), res in zip(shard, retrieved, strict=True) if i not in BAD]
        known = [[it for it in res.items if ranker.catalog.row_of(it.item_id) is not None] for _, res in users]
        requests = [
            RankRequest(history=[Event(**e) for e in r["history"]], candidates=[it.item_id for it in k])
            for (r, _), k in zip(users, known, strict=True)
        ]
        ranked = iter(ranker.rank([q for q in requests if q.candidates]))
        for (row, res), k, q in zip(users, known, requests, strict=True):
            scores = {it.item_id: it.scores for it in next(ranked).items} if q.candidates else {}
            order = sorted(k, key=lambda it: -scores[it.item_id][TASK]) + [
                it for it in res.items if it.item_id not in scores
            ]
            for final, item in enumerate(order[:RESULTS], 1):
                probs = scores.get(item.item_id, {})
                out.append((row["user_id"], final, res.items.index(item) + 1, item.item_id, item.logprob, probs))
    return out


def test_two_stages_equal_retrieve_then_rank_in_process(reference, users, engine, ranker, tiny_dir, hstu_dir):
    spec, summary = reference
    table = pq.read_table(Path(spec.out) / RECOMMENDATIONS)
    tasks = ("click", "like", "long_view")
    assert table.column_names == [
        "user_id", "rank", "retrieval_rank", "item_id", "semantic_id", "retrieval_logprob", "code_logprob", "score",
        *(f"prob_{t}" for t in tasks), "degraded", "degraded_reason", "model_version", "catalog_version",
        "ranker_version", "run_id",
    ]  # fmt: skip
    assert not any(table.column("degraded").to_pylist()) and table.column("degraded_reason").null_count == len(table)
    expected = expected_rows(engine, ranker, users[1])
    got = table.to_pylist()
    assert [(r["user_id"], r["rank"], r["retrieval_rank"], r["item_id"]) for r in got] == [e[:4] for e in expected]
    assert np.allclose([r["retrieval_logprob"] for r in got], [e[4] for e in expected], atol=1e-5)
    got_probs = [[math.nan if r[f"prob_{t}"] is None else r[f"prob_{t}"] for t in tasks] for r in got]
    want = [[e[5].get(t, math.nan) for t in tasks] for e in expected]
    assert np.allclose(got_probs, want, atol=1e-6, equal_nan=True)

    unknown = [r for r in got if r["prob_like"] is None]
    assert unknown and len(unknown) < len(got), "the test needs users with items unknown to the ranker"
    for user in {r["user_id"] for r in unknown}:  # unknown items come after the ranked ones
        flags = [r["prob_like"] is None for r in got if r["user_id"] == user]
        assert flags == sorted(flags)
    assert (summary.users, summary.processed, summary.errors, summary.degraded_users) == (USERS, USERS, len(BAD), 0)
    assert summary.rows_written == len(got) == (USERS - len(BAD)) * RESULTS
    assert summary.model_version == model_version(tiny_dir) == table.column("model_version").unique().to_pylist()[0]
    assert table.column("catalog_version").unique().to_pylist() == [summary.catalog_version] == [engine.catalog.version]
    assert summary.ranker_version == model_version(hstu_dir) == table.column("ranker_version").unique().to_pylist()[0]
    manifest = json.loads((Path(spec.out) / "manifest.json").read_text())
    assert manifest["ranker_version"] == summary.ranker_version and manifest["rank_task"] == TASK


def test_bad_histories_and_prompts_are_error_rows(reference):
    spec, _ = reference
    errors = pq.read_table(Path(spec.out) / "errors").to_pylist()
    assert [(e["row"], e["field"], e["user_id"]) for e in errors] == [(r, f, f"u{r:02d}") for r, f in BAD.items()]
    assert all(e["reason"] for e in errors)
    assert "unknown item 'no-such-item'" in errors[1]["reason"]


def job_env(ray_cluster) -> dict:
    return {
        **os.environ,
        "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address,  # the session cluster, as a second driver
        "RAY_AUTH_MODE": "disabled",
        "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
    }


def job_flags(spec: FunnelSpec) -> list[str]:
    flags = ["--model", spec.model, "--ranker", spec.ranker, "--users", spec.users, "--out", spec.out]
    flags += ["--beam-width", str(BEAM), "--num-results", str(RESULTS), "--batch-size", str(BATCH)]
    return [*flags, "--rank-task", TASK, "--no-progress", "--max-error-fraction", "0.5"]


def test_a_partial_run_resumes_to_the_same_bytes(ray_cluster, reference, tmp_path):
    spec, summary = reference
    out = tmp_path / "out"
    files = {p.relative_to(spec.out): p.read_bytes() for p in Path(spec.out).rglob("part-*.parquet")}
    for name, data in files.items():  # a run killed after shards 0 and 2: shards 1 and 3 are missing
        if name.name not in ("part-000001.parquet", "part-000003.parquet"):
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(data)
    (out / "manifest.json").write_bytes((Path(spec.out) / "manifest.json").read_bytes())
    job = [
        sys.executable,
        str(REPO / "jobs" / "batch_recommend.py"),
        *job_flags(spec.model_copy(update={"out": str(out)})),
    ]
    rerun = subprocess.run([*job, "--rank-actors", "2", "--rank-cpus-per-actor", "0.25"], env=job_env(ray_cluster),
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    line = next(x for x in rerun.stdout.splitlines() if x.startswith("batch summary: "))
    again = json.loads(line.removeprefix("batch summary: "))
    assert (again["processed"], again["skipped_as_done"]) == (2 * BATCH, USERS - 2 * BATCH)
    assert again["run_id"] == summary.run_id and again["ranker_version"] == summary.ranker_version
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("part-*.parquet")} == files


def test_stages_in_process_hand_a_committed_shard_on_as_skipped(reference, tmp_path):
    """A retried or late task of a committed shard: stage 1 computes nothing, stage 2 reports it skipped."""
    spec, _ = reference
    shard = UsersInput(spec.users, BeamOrder.layout).shards(BATCH)[0]
    handed = ShardWorker(BeamOrder(spec), run_id="r", hand_on=True)(pa.Table.from_pylist([shard.as_row()]))
    assert handed.num_rows == 1 and handed.column("results")[0].as_py() is None
    stage2 = ShardWorker(RankRetrieved(spec), run_id="r")
    (report,) = stage2(handed).to_pylist()
    assert report["skipped"] and report["users"] == BATCH and report["rows"] > 0


def test_funnel_table_orders_by_the_task_ties_in_stage_1_order_unknown_items_last():
    stage1 = recommendations_table(
        pa.array(["a", "b"]),
        [0, 1],
        [retrieved(["x", "y", "z", "w"]), retrieved(["v"])],
        scored=False,
        versions=Versions("m", "c"),
        run_id="r",
    )
    stage1 = stage1.append_column(ROW, pa.array([0, 0, 0, 0, 1], pa.int64()))
    scores = {"x": 0.2, "z": 0.7, "w": 0.7}  # y is unknown to the ranker; z and w tie
    ranked = RankResult(items=[RankedItem(item_id=i, scores={"like": p}) for i, p in scores.items()], history_events=1)
    knows_none = RankResult(items=[], history_events=1)  # the ranker skipped every item of b
    table = funnel_table(stage1, {0: ranked, 1: knows_none}, ("like",), "like", "rv").to_pylist()
    assert [(r["user_id"], r["rank"], r["retrieval_rank"], r["item_id"], r["prob_like"]) for r in table] == [
        ("a", 1, 3, "z", 0.7), ("a", 2, 4, "w", 0.7), ("a", 3, 1, "x", 0.2), ("a", 4, 2, "y", None),
        ("b", 1, 1, "v", None),
    ]  # fmt: skip
    assert {(r["model_version"], r["catalog_version"], r["ranker_version"]) for r in table} == {("m", "c", "rv")}
    assert not any(r["degraded"] for r in table)
    first_two = funnel_table(stage1, {0: ranked, 1: knows_none}, ("like",), "like", "rv", num_results=2).to_pylist()
    assert [(r["user_id"], r["rank"], r["item_id"]) for r in first_two] == [("a", 1, "z"), ("a", 2, "w"), ("b", 1, "v")]
    assert funnel_table(stage1, {}, ("like",), "like", "rv").num_rows == 0  # every user refused
    assert funnel_table(stage1.slice(0, 0), {}, ("like",), "like", "rv").num_rows == 0  # no user retrieved


def batch_in_process(spec: FunnelSpec) -> tuple[list[dict], list[dict]]:
    """(result rows, error rows) of the funnel's two stages run in this process, shard by shard (no Ray)."""
    (first, _), (second, _) = stages_of(spec, Execution(), RankingExecution())
    OutputDir(spec.out, RECOMMENDATIONS).open_run(spec.identity("v", "in"))
    one, two = ShardWorker(first, run_id="r", hand_on=True), ShardWorker(second, run_id="r")
    for shard in UsersInput(spec.users, first.layout).shards(BATCH):
        two(one(pa.Table.from_pylist([shard.as_row()])))
    out = Path(spec.out)
    return pq.read_table(out / RECOMMENDATIONS).to_pylist(), pq.read_table(out / "errors").to_pylist()


def test_online_and_batch_agree_when_the_ranker_knows_none_of_the_items(
    engine, ranker, tiny_dir, hstu_dir, tmp_path, monkeypatch
):
    """One rule for both: the retriever's recommend in beam order (its beams, then the given items it keeps), the
    ranker skipping what it does not know after checking the history. Where it knows none of a user's items: no
    error and not degraded, the items in stage 1's order unranked, online as nightly; a bad history is still the
    user's error (online a 422, nightly an error row) naming the same field."""
    from tests.funnel_ingress import two_stage

    only_retrievers = [f"item-{i:06d}" for i in range(HSTU_TINY.items, 300)]  # the ranker's catalog stops at 120
    prompt = random_prompt(engine, 24, torch.Generator().manual_seed(11))
    user = {"prompt_token_ids": prompt, "allowed_item_ids": only_retrievers,
            "candidates": [only_retrievers[40], only_retrievers[2], only_retrievers[40]]}  # fmt: skip
    good = history(random.Random(11), 5)
    rows = [{"user_id": "good", **user, "history": good}, {"user_id": "bad", **user, "history": [{"item_id": "no"}]}]
    users = tmp_path / "users.parquet"
    pq.write_table(pa.Table.from_pylist(rows), users)
    spec = funnel_spec(tiny_dir, hstu_dir, users, tmp_path / "out")  # num_results=RESULTS, as the body below
    results, errors = batch_in_process(spec)
    assert [(e["user_id"], e["field"]) for e in errors] == [("bad", "history[0].item_id")]
    nightly = [(r["item_id"], r["prob_like"], r["degraded"]) for r in results]
    assert {r["user_id"] for r in results} == {"good"}
    assert [r["rank"] for r in results] == [r["retrieval_rank"] for r in results] == list(range(1, len(nightly) + 1))

    body = {"prompt_token_ids": prompt, "beam_width": BEAM, "num_results": RESULTS, "allowed_item_ids": only_retrievers,
            "candidates": [{"item_id": i} for i in user["candidates"]], "rank_task": TASK}  # fmt: skip
    status, answer, calls = two_stage(engine, ranker, body | {"history": good}, monkeypatch)
    assert status == 200, answer
    assert [(c.deployment, c.method) for c in calls] == [("retriever", "recommend"), ("ranker", "rank")]
    assert calls[1].result.items == []  # the ranker knew none: nothing ranked, no error
    online = [(i["item_id"], None, answer["degraded"]) for i in answer["items"]]
    assert online == nightly and len(online) == RESULTS  # every beam ranked, the first RESULTS kept, both
    assert [i.item_id for i in calls[0].result.items][: len(online)] == [i for i, _, _ in online]  # stage 1's order
    joined = [i for i in calls[0].result.items if i.item_id == only_retrievers[40]]
    assert len(joined) == 1 and "given" in joined[0].source  # the given item joined stage 1, once
    assert all(i["ranker_scores"] is None for i in answer["items"]) and not answer["degraded"]
    status, answer, _ = two_stage(engine, ranker, body | {"history": [{"item_id": "no"}]}, monkeypatch)
    assert status == 422 and answer["details"][0]["field"] == "history[0].item_id"


def retrieved(item_ids: list[str]) -> RetrieveResult:
    items = [RetrievedItem(item_id=i, semantic_id=[1, 2], logprob=-k) for k, i in enumerate(item_ids)]
    return RetrieveResult(items=items, prompt_tokens=1)


def test_the_run_identity_holds_the_ranker(tiny_dir, hstu_dir, tmp_path):
    funnel = funnel_spec(tiny_dir, hstu_dir, "u", "o")
    identity = funnel.identity("v", "in")
    assert identity["ranker_version"] == model_version(hstu_dir) and identity["rank_task"] == TASK
    assert funnel_spec(tiny_dir, hstu_dir, "u", "o", rank_task=None).rank_task == "click"  # the first task
    OutputDir(str(tmp_path / "a"), RECOMMENDATIONS).open_run(identity)
    plain = RecommendSpec(**funnel.model_dump(exclude={"ranker", "rank_task"})).identity("v", "in")
    with pytest.raises(GenrecError, match="another run .*job: 'funnel' -> None"):
        OutputDir(str(tmp_path / "a"), RECOMMENDATIONS).open_run(plain)  # a plain recommend into a funnel's output
    OutputDir(str(tmp_path / "b"), RECOMMENDATIONS).open_run(plain)
    with pytest.raises(GenrecError, match="another run .*job: None -> 'funnel'"):
        OutputDir(str(tmp_path / "b"), RECOMMENDATIONS).open_run(identity)
    other_task = funnel_spec(tiny_dir, hstu_dir, "u", "o", rank_task="click").identity("v", "in")
    with pytest.raises(GenrecError, match="rank_task: 'like' -> 'click'"):
        OutputDir(str(tmp_path / "a"), RECOMMENDATIONS).open_run(other_task)


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("unknown task", "error: --rank-task: 'watch' is not a task of the ranker"),
        ("qwen3 ranker", "error: --ranker: "),
        ("pool without ranker", "error: --rank-actors applies to the ranking stage: give --ranker too"),
        ("no history", "needs a column 'history'"),
    ],
)
def test_bad_ranking_flags_exit_2_naming_the_flag(case, fragment, tiny_dir, hstu_dir, tmp_path):
    users = tmp_path / "users.parquet"
    pq.write_table(pa.table({"user_id": ["a"], "prompt": ["hello"], "history": [[{"item_id": "item-000001"}]]}), users)
    flags = ["--model", str(tiny_dir), "--users", str(users), "--out", str(tmp_path / "out")]
    flags += {
        "unknown task": ["--ranker", str(hstu_dir), "--rank-task", "watch"],
        "qwen3 ranker": ["--ranker", str(tiny_dir)],
        "pool without ranker": ["--rank-actors", "2"],
        "no history": ["--ranker", str(hstu_dir)],
    }[case]
    if case == "no history":
        pq.write_table(pa.table({"user_id": ["a"], "prompt": ["hello"]}), users)
    job = [sys.executable, str(REPO / "jobs" / "batch_recommend.py"), *flags]
    done = subprocess.run(
        job, capture_output=True, text=True, timeout=120, env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and fragment in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_the_funnel_as_a_stage_of_the_callers_pipeline_gives_the_jobs_rows(reference, users, tmp_path):
    """genrec.data.Recommend with a ranker over a Dataset of the users' rows (its two stages, each on its own
    actors): the funnel job's rows; the bad rows of either stage as rows with their error."""
    import ray

    import genrec.data

    spec, _ = reference
    settings = dict(beam_width=BEAM, num_results=RESULTS, batch_size=BATCH, rank_task=TASK)
    funnel = genrec.data.Recommend(spec.model, ranker=spec.ranker, rank_actors=1, **settings)
    mine = funnel(ray.data.from_items(users[1])).take_all()
    job = pq.read_table(Path(spec.out) / RECOMMENDATIONS).to_pylist()
    same = ("user_id", "rank", "retrieval_rank", "item_id", "degraded", "ranker_version")
    good = sorted((r for r in mine if r["error_reason"] is None), key=lambda r: (r["user_id"], r["rank"]))
    assert [[r[c] for c in same] for r in good] == [[r[c] for c in same] for r in job]
    probs = [[math.nan if r["prob_like"] is None else r["prob_like"] for r in rows] for rows in (good, job)]
    assert np.allclose(*probs, atol=1e-6, equal_nan=True)
    bad = sorted((r["user_id"], r["error_field"]) for r in mine if r["error_reason"] is not None)
    assert bad == [(f"u{row:02d}", field) for row, field in BAD.items()]
