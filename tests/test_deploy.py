"""`genrec deploy`: a config that does not pass `genrec.serving.check` (here a live `user_config` Serve would hand to
the replicas unchecked) is refused before anything is sent; one that passes goes through a real `serve deploy` to a
`ray start --head` cluster with its dashboard (tests/dashboard_cluster.py), and a refused redeploy leaves the
running app and its config as they were; a catalog no replica could load, or one missing here, is refused too (the
checks themselves: tests/test_deploy_catalog_check.py); a deploy whose catalog a replica does not serve exits 1
naming it."""

import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import yaml

from genrec.catalog.catalog import Catalog, catalog_version
from genrec_bench.common import free_port
from tests.dashboard_cluster import dashboard_cluster

GENREC = [sys.executable, "-m", "genrec.cli", "deploy"]


def serve_config(model_dir, port: int, max_queue) -> dict:
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": "genrec",
                "route_prefix": "/",
                "import_path": "genrec.serving.app:build_app",
                "args": {
                    "retriever": {"model_dir": str(model_dir), "deployment": {"ray_actor_options": {"num_cpus": 0.5}}},
                    "ingress": {"deployment": {"ray_actor_options": {"num_cpus": 0.1}}},
                },
                "deployments": [{"name": "EngineServer", "user_config": {"max_queue": max_queue}}],
            }
        ],
    }


def write(path, config: dict):
    path.write_text(yaml.safe_dump(config))
    return path


def refused(path, expected: str) -> None:
    """`genrec deploy path` exits 2 saying `expected`, and sends nothing to the address it is given."""
    listener = socket.create_server(("127.0.0.1", 0))  # where a deploy would go: it must see no connection
    address = f"http://127.0.0.1:{listener.getsockname()[1]}"
    done = subprocess.run([*GENREC, str(path), "-a", address], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and expected in done.stderr and "not deployed" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    listener.settimeout(0.5)
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()


def test_a_config_that_fails_the_check_is_refused_and_nothing_is_sent(tiny_dir, tmp_path):
    config = write(tmp_path / "bad.yaml", serve_config(tiny_dir, 8000, max_queue=0))
    refused(config, "applications[0].deployments[0].user_config.max_queue")


def test_a_rayservice_file_is_checked_not_deployed(tmp_path):
    config = serve_config("/nonexistent", 8000, max_queue=4)
    service = {"kind": "RayService", "spec": {"serveConfigV2": yaml.safe_dump(config)}}
    refused(write(tmp_path / "svc.yaml", service), "apply it with kubectl")


def test_a_catalog_no_replica_could_load_is_refused_and_nothing_is_sent(tiny_dir, tmp_path):
    """A truncated catalog (checked without --model, as a replica reads the file), and one missing here: either
    would leave every replica that starts refusing requests."""
    cut = tmp_path / "cut.parquet"
    cut.write_bytes((tiny_dir / "genrec/catalog.parquet").read_bytes()[:100])
    config = serve_config(tiny_dir, 8000, max_queue=4)
    field = "applications[0].deployments[0].user_config.catalog"
    config["applications"][0]["deployments"][0]["user_config"]["catalog"] = str(cut)
    refused(write(tmp_path / "cut.yaml", config), f"{field}: {cut}: not a readable Parquet file")
    config["applications"][0]["deployments"][0]["user_config"]["catalog"] = str(tmp_path / "later.parquet")
    refused(write(tmp_path / "later.yaml", config), f"{field}: {tmp_path / 'later.parquet'}: catalog file is missing")


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "applications: [{name: x, deployments: oops}]\n"])
def test_a_file_that_is_no_serve_config_is_refused_in_one_line_each(tmp_path, text):
    path = tmp_path / "odd.yaml"
    path.write_text(text)
    refused(path, "error: ")


def test_the_report_names_each_replica_not_serving_the_declared_catalog_and_finds_the_app():
    from genrec.serving.rollout import _replica_problem, app_url

    declared = {"catalog_status": "declared", "catalog_version": "v1", "catalog_declared": "/m/c.parquet"}
    reported = {
        "a": declared,
        "b": declared | {"catalog_version": "v0"},  # the file changed in place after it loaded it
        "c": declared | {"catalog_status": "refusing", "catalog_version": None, "catalog_refused": "file is missing"},
    }
    problems = {r: _replica_problem("genrec", r, reported, "v1") for r in ("a", "b", "c", "d")}
    assert problems["a"] is None and _replica_problem("genrec", "b", reported, None) is None  # unreadable here
    assert "replica b serves catalog_version v0, not the declared file's v1" in problems["b"][1]
    assert "replica c does not serve the declared catalog /m/c.parquet: refusing" in problems["c"][1]
    assert "(file is missing)" in problems["c"][1] and "replica d has not reported" in problems["d"][1]
    details = {"http_options": {"host": "0.0.0.0", "port": 8000}, "applications": {"x": {"route_prefix": "/x"}}}
    assert app_url("http://head:8265", details, "x") == "http://head:8000/x"
    details["http_options"]["host"] = "10.0.0.7"
    assert app_url("head:8265", details, "x") == "http://10.0.0.7:8000/x"


@pytest.mark.integration
@pytest.mark.timeout(1200)  # a `ray start` cluster (started again if its head exits), then deploys
def test_deploy_sends_a_good_config_and_refuses_a_bad_redeploy(tiny_dir, tmp_path):
    with dashboard_cluster() as (address, env):
        port = free_port()  # taken now: the cluster's start opens many ephemeral ports
        good = write(tmp_path / "good.yaml", serve_config(tiny_dir, port, max_queue=7))
        done = subprocess.run([*GENREC, str(good), "-a", address], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        url = f"http://127.0.0.1:{port}"
        retrieve = {"prompt_token_ids": [1, 2, 3], "beam_width": 2}
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.post(f"{url}/v1/retrieve", json=retrieve, timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the deployed app did not answer"
            time.sleep(1)

        bad = write(tmp_path / "bad.yaml", serve_config(tiny_dir, port, max_queue=0))
        done = subprocess.run([*GENREC, str(bad), "-a", address], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "user_config.max_queue" in done.stderr, done.stderr
        assert httpx.post(f"{url}/v1/retrieve", json=retrieve, timeout=30).status_code == 200
        serve_bin = [sys.executable, "-m", "ray.serve.scripts"]
        running = subprocess.run(
            [*serve_bin, "config", "-a", address], env=env, capture_output=True, text=True, timeout=120
        )
        assert running.returncode == 0, running.stderr
        (app,) = [a for a in yaml.safe_load_all(running.stdout) if a]  # the cluster's: still the good config
        assert app["deployments"][0]["user_config"] == {"max_queue": 7}, running.stdout

        # A catalog missing here is refused, unless the deploy says it arrives later: then it goes through (Serve
        # hands the user_config to the running replica, which keeps its catalog until the file appears), the file
        # arrives while genrec deploy waits, the replica converges on it, and the deploy ends well: exit 0.
        config = serve_config(tiny_dir, port, max_queue=7)
        arriving = tmp_path / "arriving.parquet"
        config["applications"][0]["deployments"][0]["user_config"]["catalog"] = str(arriving)
        later = write(tmp_path / "later.yaml", config)
        done = subprocess.run(
            [*GENREC, str(later), "-a", address], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2 and "--catalog-arrives" in done.stderr, done.stdout + done.stderr
        deploying = subprocess.Popen(
            [*GENREC, str(later), "-a", address, "--catalog-arrives"], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 300
        while "kept_running" not in httpx.get(f"{url}/v1/model", timeout=30).text:  # the replica has it, without it
            assert time.monotonic() < deadline and deploying.poll() is None, deploying.communicate()
            time.sleep(0.5)
        catalog = Catalog.load(tiny_dir / "genrec/catalog.parquet")
        rows = np.arange(0, len(catalog), 2)
        Catalog(catalog.item_ids[rows], catalog.codes[rows], catalog.lengths[rows]).save(arriving)
        out, err = deploying.communicate(timeout=120)
        assert deploying.returncode == 0 and not [x for x in err.splitlines() if x.startswith("error: ")], out + err
        answer = httpx.post(f"{url}/v1/retrieve", json=retrieve, timeout=30).json()
        assert answer["catalog_version"] == catalog_version(arriving)
