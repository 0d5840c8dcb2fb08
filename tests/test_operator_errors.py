"""An operator's mistake is one `error:` line and exit status 2, never a traceback: `genrec deploy` to a dashboard that
does not answer, `genrec bench cache` without a redis-server; and a batch job given relative paths while RAY_ADDRESS
names a running cluster runs (the driver makes local paths absolute, so the actors, in the cluster's working
directory, find them). A model that disagrees with its config: tests/test_model_shapes.py."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from genrec.batch.spec import RankSpec
from tests import rank_inputs
from tests.test_cli_errors import run_main

REPO = Path(__file__).resolve().parents[1]


def deploy(config: Path, address: str, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "genrec.cli", "deploy", str(config), "-a", address, *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.fixture
def config(tmp_path) -> Path:
    """A Serve config that passes the check (its model directory is read only with --model)."""
    app = {"name": "genrec", "route_prefix": "/", "import_path": "genrec.serving.app:build_app"}
    app["args"] = {"retriever": {"model_dir": "/models/genrec"}}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"applications": [app]}))
    return path


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the block ends: a connection is refused


@pytest.mark.parametrize("dashboard", ["refuses", "never answers"])
def test_deploy_to_a_dashboard_that_does_not_answer_is_one_line(config, dashboard):
    if dashboard == "refuses":
        address, listener = f"http://127.0.0.1:{closed_port()}", None
    else:  # accepts the connection (the kernel's backlog) and never answers
        listener = socket.create_server(("127.0.0.1", 0))
        address = f"127.0.0.1:{listener.getsockname()[1]}"  # no scheme: serve deploy's default, http
    try:
        done = deploy(config, address, "--dashboard-timeout-s", "2")
    finally:
        if listener is not None:
            listener.close()
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if not line.startswith("warning: ")]  # the model dir is remote
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert errors[0].startswith(f"error: {config}: not deployed: the Ray dashboard at {address} does not answer")
    if dashboard == "never answers":
        assert "waited up to 2 s" in done.stderr, done.stderr  # --dashboard-timeout-s


def test_bench_cache_without_redis_server_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no redis-server on the PATH
    err = run_main(monkeypatch, capsys, "bench", "cache", "--keys", "10")
    assert err.startswith("error: redis-server not found on the PATH") and err.count("\n") == 1
    assert "--redis-url" in err


def test_local_paths_are_made_absolute_on_the_driver(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", "/home/op")
    spec = RankSpec(model="models/hstu", users="s3://bucket/users/", out="~/ranked")
    assert (spec.model, spec.users, spec.out) == (f"{tmp_path}/models/hstu", "s3://bucket/users/", "/home/op/ranked")
    assert RankSpec(model="../m", users="./u.parquet", out=str(tmp_path)).model == str(tmp_path.parent / "m")


def test_a_job_with_relative_paths_runs_on_the_cluster_ray_address_names(ray_cluster, tmp_path):
    """The driver runs in another working directory than the cluster's workers (the session's cluster was started
    from the test's): relative --model, --users and --out are the driver's, and the job computes every user."""
    rank_inputs.model_dir(tmp_path)
    rows = rank_inputs.users_rows(5, seed=3)
    rank_inputs.write_users(tmp_path / "users.parquet", rows)
    assert Path.cwd() != tmp_path
    env = os.environ | {"RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address, "RAY_AUTH_MODE": "disabled"}
    flags = ["--model", "hstu", "--users", "users.parquet", "--out", "out", "--rank-by", "click", "--no-progress"]
    command = [sys.executable, str(REPO / "jobs" / "batch_rank.py"), *flags, "--cpus-per-actor", "0.25"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("batch summary: "))
    summary = json.loads(line.removeprefix("batch summary: "))
    assert (summary["processed"], summary["errors"], summary["out"]) == (5, 0, str(tmp_path / "out"))
    assert pq.read_table(tmp_path / "out" / "rankings").num_rows == sum(len(r["candidates"]) for r in rows)
