"""Batch input rules (both jobs): a user_id that comes again is refused into errors/ (the first row in input order is
the user's, in whichever shard, file or run the repeat falls) and counted in the summary; an output that cannot be
written is one `error:` line and exit 2 before any work; GPUs per actor that the cluster cannot give are refused at
once instead of waited for forever."""

import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from genrec.batch import Execution, RankSpec, RecommendSpec, pipeline, run
from genrec.batch.connect import check_gpus
from genrec.batch.output import ERRORS, OutputDir
from genrec.batch.shards import Repeat, UsersInput
from genrec.batch.stages import Rank, Retrieve
from genrec.batch.worker import ShardWorker
from genrec.errors import GenrecError
from genrec.model.directory import model_version
from tests import rank_inputs
from tests.shard_runs import run_shard

REPO = Path(__file__).resolve().parents[1]
BEAM = 3

# Two files of one input (read in name order: a/part-0.parquet, then b.parquet); shards of 2 rows.
A = "a/part-0.parquet"
FIRST = [10, 11, 10, None, 12, 13]  # row 1 (user 11) is bad: an empty prompt
SECOND = [12, 11, 14, 14]
# (file, row) -> (field, reason) of every refused row; None: the job's own bad row (its field, any reason)
REFUSED = {
    ("part-0.parquet", 1): None,
    ("part-0.parquet", 2): ("user_id", "repeats row 0"),
    ("part-0.parquet", 3): ("user_id", "is null"),
    ("b.parquet", 0): ("user_id", "repeats row 4 of a/part-0.parquet"),
    ("b.parquet", 1): ("user_id", "repeats row 1 of a/part-0.parquet"),  # the user's row is bad: still the user's
    ("b.parquet", 3): ("user_id", "repeats row 2"),
}
KEPT = {10, 12, 13, 14}


def write_prompt_users(root: Path) -> Path:
    (root / "users" / "a").mkdir(parents=True)
    for path, ids in ((root / "users" / "a" / "part-0.parquet", FIRST), (root / "users" / "b.parquet", SECOND)):
        prompts = ["   " if (path.name, row) == ("part-0.parquet", 1) else f"user {u} likes podcasts row {row}"
                   for row, u in enumerate(ids)]  # fmt: skip
        pq.write_table(pa.table({"user_id": pa.array(ids, pa.int64()), "prompt": prompts}), path)
    return root / "users"


def write_rank_users(root: Path) -> Path:
    rows = rank_inputs.users_rows(len(FIRST) + len(SECOND), seed=4)
    for row, user_id in zip(rows, FIRST + SECOND, strict=True):
        row["user_id"] = None if user_id is None else str(user_id)
    rows[1]["candidates"] = []  # user 11's row is bad
    (root / "users" / "a").mkdir(parents=True)
    rank_inputs.write_users(root / "users" / "a" / "part-0.parquet", rows[: len(FIRST)])
    rank_inputs.write_users(root / "users" / "b.parquet", rows[len(FIRST) :])
    return root / "users"


def run_all_shards(job, reverse: bool = False):
    """Every shard of the input through one worker in-process (no Ray), as Ray Data would call it, in either order."""
    shards = UsersInput(job.spec.users, job.layout).shards(job.spec.batch_size)
    OutputDir(job.spec.out, job.results).open_run({})
    worker = ShardWorker(job, run_id="r")
    for shard in reversed(shards) if reverse else shards:
        run_shard(worker, shard)
    return shards


def refused_rows(out: str, shards, bad_field: str) -> dict:
    """The errors of `shards` as REFUSED writes them: `bad_field` is the field of the one bad row."""
    found = {}
    for shard in shards:
        for e in pq.read_table(Path(out) / ERRORS / shard.name).to_pylist():
            found[(Path(shard.path).name, e["row"])] = None if e["field"] == bad_field else (e["field"], e["reason"])
    return found


def test_repeated_user_ids_are_found_over_the_whole_input(tmp_path):
    users = UsersInput(str(write_prompt_users(tmp_path)), Retrieve.layout)
    shards = users.shards(2)
    assert [(Path(s.path).name, s.start, s.repeats) for s in shards] == [
        ("part-0.parquet", 0, ()),
        ("part-0.parquet", 2, (Repeat(0, "repeats row 0"),)),  # a null user_id repeats nothing
        ("part-0.parquet", 4, ()),
        ("b.parquet", 0, (Repeat(0, f"repeats row 4 of {A}"), Repeat(1, f"repeats row 1 of {A}"))),
        ("b.parquet", 2, (Repeat(1, "repeats row 2"),)),
    ]  # fmt: skip
    assert [len(s.repeats) for s in users.shards(100)] == [1, 3]  # the same rows, whatever the batch size


@pytest.mark.parametrize("reverse", [False, True])
def test_the_recommend_job_keeps_the_first_row_of_each_user(tiny_dir, tmp_path, reverse):
    users = write_prompt_users(tmp_path)
    spec = RecommendSpec(
        model=str(tiny_dir), users=str(users), out=str(tmp_path / "out"), beam_width=BEAM, batch_size=2
    )
    shards = run_all_shards(Retrieve(spec), reverse)
    assert refused_rows(spec.out, shards, "prompt") == REFUSED
    output = pq.read_table(tmp_path / "out" / "recommendations").to_pylist()
    assert {r["user_id"] for r in output} == KEPT
    assert len({(r["user_id"], r["rank"]) for r in output}) == len(output) == len(KEPT) * BEAM  # one list per user


def test_shards_run_in_any_order_write_the_same_files(tiny_dir, tmp_path):
    users = write_prompt_users(tmp_path)
    files = []
    for name, reverse in (("forward", False), ("reverse", True)):
        out = tmp_path / name
        spec = RecommendSpec(model=str(tiny_dir), users=str(users), out=str(out), beam_width=BEAM, batch_size=2)
        run_all_shards(Retrieve(spec), reverse)
        files.append({p.relative_to(out): p.read_bytes() for p in out.rglob("part-*.parquet")})
    assert files[0] == files[1] and len(files[0]) == 2 * 5


def test_the_rank_job_keeps_the_first_row_of_each_user(tmp_path):
    users = write_rank_users(tmp_path)
    model = rank_inputs.model_dir(tmp_path)
    spec = RankSpec(model=str(model), users=str(users), out=str(tmp_path / "out"), batch_size=2, rank_by="click")
    shards = run_all_shards(Rank(spec), reverse=True)
    assert refused_rows(spec.out, shards, "candidates") == REFUSED
    output = pq.read_table(tmp_path / "out" / "rankings").to_pylist()
    assert {r["user_id"] for r in output} == {str(u) for u in KEPT}
    assert len({(r["user_id"], r["rank"]) for r in output}) == len(output)


def test_a_null_in_a_row_is_refused_in_genrecs_words():
    """A null where an object, text or a number must be: the error row says so as the HTTP 422 does (issue #46,
    item 6: these reasons were pydantic's, e.g. "Input should be a valid dictionary or instance of Candidate")."""
    from genrec.api import RecommendRequest
    from genrec.batch.stages import validate_rows

    candidate = pa.struct([("item_id", pa.string())])
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    table = pa.table(
        {
            "user_id": pa.array([1, 2, 3, 4], pa.int64()),
            "prompt": pa.array(["x", None, None, "x"], pa.string()),
            "messages": pa.array([None, [None], None, None], pa.list_(message)),
            "prompt_token_ids": pa.array([None, None, [3, None], None], pa.list_(pa.int64())),
            "candidates": pa.array([[{"item_id": "a"}, None], None, None, None], pa.list_(candidate)),
        }
    )
    wanted = ["prompt", "messages", "prompt_token_ids", "candidates"]
    parsed = validate_rows(table, RecommendRequest, wanted, {"beam_width": 4})
    assert [(e.position, e.field, e.reason) for e in parsed.errors] == [
        (0, "candidates[1]", "must be an object with item_id, text or token_ids; got null"),
        (1, "messages[0]", "must be an object with role and content; got null"),
        (2, "prompt_token_ids[1]", "must be an integer; got null"),
    ]
    assert parsed.positions == [3]


def test_files_whose_user_ids_differ_in_type_are_refused(tmp_path):
    pq.write_table(pa.table({"user_id": [42], "prompt": ["x"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"user_id": ["42"], "prompt": ["x"]}), tmp_path / "b.parquet")
    with pytest.raises(GenrecError, match="b.parquet: column 'user_id' is string, .*a.parquet's int64"):
        UsersInput(str(tmp_path), Retrieve.layout)


def test_repeats_through_ray_are_counted_and_a_rerun_rebuilds_the_same_files(ray_cluster, tiny_dir, tmp_path):
    users = write_prompt_users(tmp_path)
    spec = RecommendSpec(
        model=str(tiny_dir), users=str(users), out=str(tmp_path / "out"), beam_width=BEAM, batch_size=2
    )
    summary = run(spec, Execution(progress=False, max_error_fraction=1.0))
    assert (summary.users, summary.repeats, summary.errors) == (10, 4, len(REFUSED))
    assert summary.rows_written == len(KEPT) * BEAM
    assert json.loads(summary.line().removeprefix("batch summary: "))["repeats"] == 4
    first = {p: p.read_bytes() for p in (tmp_path / "out").rglob("part-*.parquet")}
    for kind in ("recommendations", "errors"):  # the shard of the first row of user 12, as if never committed
        (tmp_path / "out" / kind / "part-000002.parquet").unlink()
    again = run(spec, Execution(progress=False))
    assert (again.processed, again.repeats, again.errors) == (2, 4, len(REFUSED))
    assert {p: p.read_bytes() for p in (tmp_path / "out").rglob("part-*.parquet")} == first


# --- an output that cannot be written -------------------------------------------------------------------------------


def run_job(script: str, *flags: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    job = [sys.executable, str(REPO / "jobs" / script), *flags]
    return subprocess.run(job, capture_output=True, text=True, timeout=timeout, env=env)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


@contextmanager
def read_only(directory: Path):
    """`directory` read-only for this process: by its mode, or for root (whom modes do not stop) by the immutable
    flag; skips the test where neither can be set."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(0o755)
        return
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", str(directory)], capture_output=True).returncode != 0:
        pytest.skip("root, and no immutable flag here to make a directory read-only")
    try:
        yield
    finally:
        subprocess.run([chattr, "-i", str(directory)], check=True)


@pytest.mark.parametrize(
    "script, case",
    [
        ("batch_recommend.py", "a file"),
        ("batch_rank.py", "a file"),
        ("batch_recommend.py", "below a file"),
        ("batch_recommend.py", "no parent"),
        ("batch_recommend.py", "not permitted"),
        ("batch_recommend.py", "read-only"),
    ],
)
def test_an_output_that_cannot_be_written_exits_2_naming_it(script, case, tiny_dir, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the output directory should be")
    out = {
        "a file": blocker,
        "below a file": blocker / "out",
        "no parent": Path("/proc/genrec-no-such-dir/out"),  # a parent nobody can create
        "not permitted": Path("/sys/genrec-out"),  # refused even to root
        "read-only": tmp_path / "read-only" / "out",
    }[case]
    (tmp_path / "read-only").mkdir()
    if script == "batch_rank.py":
        model, users = rank_inputs.model_dir(tmp_path), tmp_path / "users.parquet"
        rank_inputs.write_users(users, rank_inputs.users_rows(2, seed=1))
    else:
        model, users = tiny_dir, tmp_path / "users.parquet"
        pq.write_table(pa.table({"user_id": ["a"], "prompt": ["hello"]}), users)
    flags = ["--model", str(model), "--users", str(users), "--out", str(out)]
    with read_only(tmp_path / "read-only") if case == "read-only" else nullcontext():
        done = run_job(script, *flags, env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"})  # refused before Ray
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"error: {out}: cannot write the output directory ("), done.stderr


def test_a_rerun_into_a_read_only_output_is_refused_before_ray(tiny_dir, tmp_path, monkeypatch):
    users = tmp_path / "users.parquet"
    pq.write_table(pa.table({"user_id": ["a", "b"], "prompt": ["hello", "hi"]}), users)
    spec = RecommendSpec(model=str(tiny_dir), users=str(users), out=str(tmp_path / "out"), beam_width=BEAM)
    identity = spec.identity(model_version(tiny_dir), UsersInput(str(users), Retrieve.layout).fingerprint())
    OutputDir(spec.out, "recommendations").open_run(identity)  # the first run got this far: its manifest is there
    monkeypatch.setattr(pipeline, "ensure_ray", lambda: pytest.fail("Ray was started"))
    with read_only(tmp_path / "out" / "recommendations"):
        with pytest.raises(GenrecError, match=f"{spec.out}: cannot write the output directory"):
            run(spec)  # a shard is pending: the probe fails before Ray is started


# --- GPUs the cluster cannot give -----------------------------------------------------------------------------------


def fake_ray(gpus_by_node: list, node_types: list | None = None, joins_after_polls: int | None = None):
    """Enough of the ray module for check_gpus: nodes, cluster_resources, the autoscaler's published node types
    (None: none published) and request_resources (a GPU node joins after that many polls once asked)."""
    nodes = [{"Alive": alive, "Resources": {"CPU": 2.0, **({"GPU": g} if g else {})}} for g, alive in gpus_by_node]
    requests, polls = [], []

    def list_nodes():
        polls.append(1)
        if requests and requests[0] and joins_after_polls is not None and len(polls) > joins_after_polls:
            return [*nodes, {"Alive": True, "Resources": {"GPU": 1.0}}]
        return nodes

    config = None if node_types is None else SimpleNamespace(
        node_group_configs=[SimpleNamespace(resources=r, max_count=m) for r, m in node_types]
    )  # fmt: skip
    return SimpleNamespace(
        nodes=list_nodes,
        cluster_resources=lambda: {"GPU": sum(g for g, alive in gpus_by_node if alive)},
        _private=SimpleNamespace(state=SimpleNamespace(state=SimpleNamespace(get_cluster_config=lambda: config))),
        autoscaler=SimpleNamespace(sdk=SimpleNamespace(request_resources=lambda bundles: requests.append(bundles))),
        requests=requests,
    )


@pytest.mark.parametrize(
    "ray, per_actor",
    [
        (fake_ray([(0, True), (1.0, True)]), 1),  # a GPU node
        (fake_ray([(0, True), (0.5, True)]), 0.5),
        (fake_ray([(0, True)], node_types=[({"CPU": 8}, 2), ({"CPU": 8, "GPU": 4}, 3)]), 2),  # the autoscaler's
        (fake_ray([(0, True)]), 0),  # a CPU engine
    ],
)
def test_gpus_the_cluster_has_or_its_autoscaler_offers_pass(ray, per_actor):
    check_gpus(ray, per_actor)
    assert ray.requests == []


@pytest.mark.parametrize(
    "ray, per_actor",
    [
        (fake_ray([(0, True)]), 1),
        (fake_ray([(0, True), (1.0, False)]), 1),  # a dead GPU node
        (fake_ray([(1.0, True), (1.0, True)]), 2),  # 2 GPUs, but not on one node
        (fake_ray([(0, True)], node_types=[({"CPU": 8, "GPU": 4}, 0), ({"CPU": 8}, 3)]), 1),  # none to launch
    ],
)
def test_gpus_no_node_has_are_refused_at_once(ray, per_actor):
    start = time.monotonic()
    with pytest.raises(GenrecError, match=f"num_gpus={per_actor:g} per actor: no node of the cluster has that many"):
        check_gpus(ray, per_actor)
    assert time.monotonic() - start < 10 and ray.requests == []  # no wait for resources


def test_with_a_wait_the_autoscaler_is_asked_for_a_gpu_node_and_the_request_ends():
    ray = fake_ray([(0, True)], joins_after_polls=3)
    check_gpus(ray, 1, wait_s=5, poll_s=0.01)
    assert ray.requests == [[{"GPU": 1}], []]
    never = fake_ray([(0, True)])
    with pytest.raises(GenrecError, match=r"none joined within 0.05 s \(gpu_wait_s\)"):
        check_gpus(never, 1, wait_s=0.05, poll_s=0.01)
    assert never.requests == [[{"GPU": 1}], []]


def test_num_gpus_on_a_cluster_without_gpus_exits_2_at_once(ray_cluster, tiny_dir, tmp_path):
    users = tmp_path / "users.parquet"
    pq.write_table(pa.table({"user_id": ["a"], "prompt": ["hello"]}), users)
    env = {
        **os.environ,
        "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address,  # the session cluster: 2 CPUs, no GPU
        "RAY_AUTH_MODE": "disabled",
        "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
    }
    flags = ["--model", str(tiny_dir), "--users", str(users), "--out", str(tmp_path / "out"), "--no-progress"]
    done = run_job("batch_recommend.py", *flags, "--num-gpus", "1", env=env, timeout=120)  # today: waits forever
    (line,) = error_lines(done.stderr)
    assert done.returncode == 2 and done.stderr.strip().endswith(line), done.stderr[-3000:]
    assert "num_gpus=1 per actor: no node of the cluster has that many GPUs (it has 0 in all)" in line
    assert not (tmp_path / "out" / "manifest.json").exists()  # nothing ran: a rerun may choose other settings
    with pytest.raises(GenrecError, match="none joined within 0.5 s"):
        check_gpus(ray_cluster, 1, wait_s=0.5, poll_s=0.1)  # a cluster with no autoscaler: the wait ends
