"""cluster.yaml passes the validator that ships inside the ray package and keeps what genrec relies on."""

import copy
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def raw():
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


@pytest.fixture(scope="module")
def config(raw):
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(raw))  # merges the provider defaults, as `ray up` does
    validate_config(prepared)
    return prepared


def flags(command: str) -> dict[str, str]:
    return dict(re.findall(r"--([\w-]+)(?:=(\S+))?", command))


def test_it_validates_for_a_real_provider(config):
    assert config["provider"]["type"] == "aws"
    assert config["docker"]["image"] and config["docker"]["container_name"]


def test_no_work_on_the_head_and_gpu_workers_scale_from_zero(config):
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"] == {"CPU": 0}
    gpu = [t for name, t in types.items() if "gpu" in name]
    cpu = [t for name, t in types.items() if "cpu" in name]
    assert len(gpu) == 1 and gpu[0]["min_workers"] == 0 and gpu[0]["max_workers"] >= 1
    assert gpu[0]["node_config"]["InstanceType"].startswith(("g", "p"))  # a GPU instance family
    assert len(cpu) == 1 and cpu[0]["min_workers"] >= 1  # ingress and cache actors always have a home
    assert config["max_workers"] >= gpu[0]["max_workers"] + cpu[0]["max_workers"]


def test_gpu_workers_hold_the_gpu_apps_largest_scale_and_a_rollouts_surge(config):
    """At gpu.yaml's max_replicas a rolling restart starts its surge first: without room it would wait."""
    from genrec.serving.args import ROLLOUT_SURGE_PERCENT, AppArgs

    (app,) = yaml.safe_load((REPO / "deployments" / "gpu.yaml").read_text())["applications"]
    largest = AppArgs.model_validate(app["args"]).retriever.deployment["autoscaling_config"]["max_replicas"]
    surge = -(-largest * ROLLOUT_SURGE_PERCENT // 100)
    (gpu,) = [t for name, t in config["available_node_types"].items() if "gpu" in name]
    assert gpu["max_workers"] >= largest + surge  # one GPU a node (the instance type)


def test_autoscaling_dashboard_and_metrics_port_are_on(config):
    (head_start,) = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    (worker_start,) = [c for c in config["worker_start_ray_commands"] if "ray start" in c]
    head, worker = flags(head_start), flags(worker_start)
    assert head["autoscaling-config"] == "~/ray_bootstrap_config.yaml"  # without it no worker ever starts
    assert head["include-dashboard"] == "true" and head["dashboard-host"] == "0.0.0.0"  # serve deploy, job submit
    assert head["metrics-export-port"] == worker["metrics-export-port"]  # pinned, the same on every node
    assert head["metrics-export-port"].isdigit()
    for command in (head_start, worker_start):
        assert "RAY_max_direct_call_object_size=4194304" in command  # cache replies travel inline
        # `ray up` exports OMP_NUM_THREADS=1: unset, each actor gets threads for the CPUs it reserves
        assert command.index("unset OMP_NUM_THREADS") < command.index("ray start")


def test_every_node_installs_this_project(raw, config):
    (target,) = [t for t, source in raw["file_mounts"].items() if source == "."]  # the repository
    assert (REPO / "pyproject.toml").exists()
    for commands in (config["head_setup_commands"], config["worker_setup_commands"]):
        assert any(f"pip install -q -e {target}" in c for c in commands)
