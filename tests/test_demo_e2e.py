"""`python -m genrec_demo` end to end on MovieLens, as a user runs it: training, the embedding-loading job, the Serve
app over HTTP, the batch job, the metrics; the guard of the demo's quality; and Ctrl-C, which must leave nothing
running."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest

USERS = 943  # all of them: the quality guard's figures need every user's held-out item
# A short training, a few CPU minutes, yet a retriever and a ranker whose orders differ measurably.
STEPS, RANKER_STEPS = 400, 600
# The quality guard: NDCG@10 of this run's orders as measured on the 2-core development machine (RECORDED_ON). Figures
# move a little across CPUs, so the test holds the funnel to beating its own beam order by MARGIN, in the same run.
RECORDED = {"ranker": 0.0948, "retrieve": 0.0548}
RECORDED_ON = "AMD EPYC, 2 cores, 2026-12-06"
MARGIN = 0.02  # half the recorded difference (+0.040; its standard error about 0.007)
ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(1800)  # the whole demo, training included: 880 s on a loaded 2-core machine


def demo(tmp: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "genrec_demo", "--steps", str(STEPS), "--port", "0"]
    command += ["--ranker-steps", str(RANKER_STEPS), "--out", str(tmp / "out"), "--model-dir", str(tmp / "model")]
    command += ["--ranker-dir", str(tmp / "ranker"), *extra]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    return subprocess.Popen(  # its own process group, as a terminal's foreground job
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=_interruptible,
    )


def _interruptible() -> None:
    """SIGINT as a terminal gives it: a suite started in the background by a non-interactive shell (`cmd &`)
    inherits it ignored, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, frontier = set(), [pid]
    while frontier:
        frontier = [c for p in frontier for c in children.get(p, [])]
        found.update(frontier)
    return found


def assert_all_gone(pids: set[int], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (alive := {p for p in pids if _running(p)}) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive, [Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in alive if _running(p)]


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("demo-e2e")


@pytest.fixture(scope="module")
def first_run(workdir) -> tuple[int, str, set[int]]:
    """The demo run once in the module's workdir, from nothing: (exit code, output, the processes it started). A
    module fixture, not the first test's own run, so that the Ctrl-C test finds a trained model however the tests
    are selected or spread."""
    process = demo(workdir)
    lines, started = [], set()
    for line in process.stdout:
        lines.append(line.rstrip())
        if "starting the Serve app" in line:
            started = descendants(process.pid)  # Ray's processes, the cache actor, the job runner's
    return process.wait(timeout=600), "\n".join(lines), started


def test_demo_runs_the_platform_end_to_end(workdir, first_run):
    code, output, started = first_run
    assert code == 0, "\n".join(output.splitlines()[-40:])
    assert "training the demo model" in output and "training the HSTU ranker" in output
    assert "user 1, last watched" in output and "funnel    (HSTU, P(watch))" in output
    for route in ("retrieve", "recommend", "recommend (two-stage)", "score"):
        assert f"POST /v1/{route}:" in output or f"POST /v1/{route} " in output
    report = json.loads((workdir / "out" / "metrics.json").read_text())
    assert report["users"] == USERS and report["embeddings_loaded"]["loaded"] == USERS
    assert report["batch"]["processed"] == USERS and report["batch"]["errors"] == 0
    recommendations = pq.read_table(workdir / "out" / "batch" / "recommendations")
    assert set(recommendations.column("user_id").to_pylist()) == set(report_users(workdir))
    assert recommendations.num_rows == USERS * 50
    assert set(report["quality@10"]) == {"retrieve", "recommend", "ranker", "popularity"}
    weight = report["ranking"]["score_weight"]  # chosen on validation items; stage 1 ranked by it
    by_user = defaultdict(list)
    for row in recommendations.to_pylist():
        by_user[row["user_id"]].append(row)
    for rows in by_user.values():
        keys = [r["code_logprob"] + weight * r["score"] for r in sorted(rows, key=lambda r: r["retrieval_rank"])]
        assert keys == sorted(keys, reverse=True)
        watch = [r["prob_watch"] for r in sorted(rows, key=lambda r: r["rank"])]  # the ranker's final order
        assert watch == sorted(watch, reverse=True)
    catalog = pq.read_table(workdir / "model" / "genrec" / "catalog.parquet").to_pylist()
    genres = {row["item_id"]: row["genres"] for row in catalog}
    decade = {row["item_id"]: row["decade"] for row in catalog}
    assert report["filtered"]["comedies"]["items"] and report["filtered"]["1980s"]["items"]
    assert all("Comedy" in genres[i] for i in report["filtered"]["comedies"]["items"])
    assert all(decade[i] == 1980 for i in report["filtered"]["1980s"]["items"])
    change = report["catalog_change"]  # retired, then added back, each version deployed live over HTTP
    assert len(set(change["versions"])) == 3 and len(change["retired"]) == 3
    assert "genrec catalog retire" in output and "genrec catalog add" in output and "(deployed live)" in output
    assert recommendations.column("catalog_version").unique().to_pylist() == [change["versions"][0]]
    assert (workdir / "out" / "recall_at_k.png").stat().st_size > 10_000
    assert started and "Serve and Ray are stopped" in output
    assert_all_gone(started)


def test_the_funnel_beats_its_own_beam_order_by_the_margin(workdir, first_run):
    """The demo's quality, guarded: a change that moves what its models learn moves these figures, and one that
    loses the ranker's gain over the beam order fails here, saying by how much."""
    assert first_run[0] == 0, "the demo run failed (see test_demo_runs_the_platform_end_to_end)"
    report = json.loads((workdir / "out" / "metrics.json").read_text())
    ndcg = {method: report["quality@10"][method]["ndcg@10"] for method in RECORDED}
    figures = ", ".join(
        f"{m} {ndcg[m]:.4f} (recorded {RECORDED[m]:.4f} on {RECORDED_ON}: {ndcg[m] - RECORDED[m]:+.4f})" for m in ndcg
    )
    print(f"NDCG@10: {figures}")
    paired = report["funnel vs beam order"]
    difference, recorded = paired["ndcg@10 difference"], RECORDED["ranker"] - RECORDED["retrieve"]
    assert difference >= MARGIN, (
        f"the funnel beats its beam order by {difference:+.4f} NDCG@10 (± {paired['standard error']:.4f}), under the "
        f"guard's {MARGIN}: recorded {recorded:+.4f}, {difference - recorded:+.4f} since; {figures}"
    )


def report_users(workdir: Path) -> list[str]:
    return pq.read_table(workdir / "out" / "users.parquet", columns=["user_id"]).column(0).to_pylist()


def test_ctrl_c_stops_serve_the_jobs_and_ray(workdir, first_run):
    process = demo(workdir)  # reuses the models the first run trained
    lines = []
    for line in process.stdout:
        lines.append(line.rstrip())
        if "starting the Serve app" in line:
            break
    started = descendants(process.pid)
    assert started, "\n".join(lines)
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    rest, _ = process.communicate(timeout=180)
    output = "\n".join(lines) + rest
    assert "reusing the trained model" in output and "reusing the trained ranker" in output
    assert process.returncode == 130, output[-3000:]
    assert "interrupted" in rest
    assert_all_gone(started | {process.pid})
