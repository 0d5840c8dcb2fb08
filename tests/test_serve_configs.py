"""The Serve config files: every key is one Serve's schema defines (Serve drops unknown keys silently, so a
typo would deploy and do nothing), `args` validate into AppArgs, and every named deployment exists."""

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from genrec.serving.app import application
from genrec.serving.args import AppArgs, EngineLimits, IngressLimits
from genrec.serving.check import deployments_of, main, problems, unknown_keys

DEPLOYMENTS = Path(__file__).resolve().parents[1] / "deployments"
FUNNELS = [DEPLOYMENTS / "funnel-local.yaml", DEPLOYMENTS / "funnel-gpu.yaml"]
CONFIGS = [DEPLOYMENTS / "local.yaml", DEPLOYMENTS / "gpu.yaml", DEPLOYMENTS / "hstu-local.yaml", *FUNNELS]
ENGINES = ("EngineServer", "RankerServer")


def deployment_names(app) -> set[str]:
    from ray.serve._private.build_app import build_app as flatten

    return {d.name for d in flatten(app, name="check").deployments}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_keys_are_serve_schema_fields(path):
    config = yaml.safe_load(path.read_text())
    assert unknown_keys(config, ServeDeploySchema) == []
    ServeDeploySchema.model_validate(config)  # and the values validate
    assert problems(config) == []  # and args, user_configs and deployment names (python -m genrec.serving.check)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_args_and_deployment_names_match_the_app(path):
    for app in yaml.safe_load(path.read_text())["applications"]:
        assert app["import_path"] == "genrec.serving.app:build_app"
        args = AppArgs.model_validate(app["args"])
        names = deployment_names(application(args))
        funnel = {"RankerServer"} if args.ranker is not None else set()
        assert names == {"Ingress", "EngineServer"} | funnel == set(deployments_of(app["args"]))  # the check's
        assert {d["name"] for d in app.get("deployments", [])} <= names
        live = {"Ingress": IngressLimits, "EngineServer": EngineLimits, "RankerServer": EngineLimits}
        for deployment in app.get("deployments", []):
            if "user_config" in deployment:  # what reconfigure() will be handed
                live[deployment["name"]].model_validate(deployment["user_config"])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_engine_deployment_routes_by_user(path):
    """The config names genrec's user router (a request_router_config without the class would select Serve's
    default) with kwargs it accepts, and the class loads as a Serve RequestRouter."""
    from ray.serve.config import RequestRouterConfig
    from ray.serve.request_router import RequestRouter

    from genrec.serving.router import USER_ROUTER, UserRouter

    for app in yaml.safe_load(path.read_text())["applications"]:
        engines = [d for d in app["deployments"] if d["name"] in ENGINES]
        assert len(engines) == (2 if "ranker" in app["args"] else 1)  # a funnel's ranker routes by user too
        for engine in engines:
            config = RequestRouterConfig(**engine["request_router_config"])  # imports the class
            assert config.request_router_class == USER_ROUTER
            assert issubclass(UserRouter, RequestRouter)
            UserRouter.__new__(UserRouter).initialize_state(**config.request_router_kwargs)


def test_the_gpu_app_keeps_two_engine_replicas_and_their_caches_through_a_dip():
    (app,) = yaml.safe_load((DEPLOYMENTS / "gpu.yaml").read_text())["applications"]
    args = AppArgs.model_validate(app["args"])
    assert args.min_replicas >= 2 and args.downscale_delay_s >= 600
    from genrec.serving.app import engine_deployment

    assert engine_deployment(args)["autoscaling_config"]["downscale_delay_s"] == args.downscale_delay_s


def test_the_checker_catches_typos():
    config = {
        "applications": [
            {
                "name": "a",
                "import_path": "x:y",
                "deployments": [{"name": "d", "max_concurrent_queries": 5, "autoscaling_config": {"target_num": 1}}],
            }
        ],
        "http_options": {"request_timeout": 3},
    }
    assert sorted(unknown_keys(config, ServeDeploySchema)) == [
        "applications[0].deployments[0].autoscaling_config.target_num",
        "applications[0].deployments[0].max_concurrent_queries",
        "http_options.request_timeout",
    ]


def test_app_args_refuse_unknown_keys_and_bad_values():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="model_dirr"):
        AppArgs.model_validate({"model_dirr": "/m"})
    with pytest.raises(ValidationError, match="max_replicas"):
        AppArgs.model_validate({"model_dir": "/m", "min_replicas": 3, "max_replicas": 2})
    assert AppArgs.model_validate({"model_dir": "relative/dir"}).model_dir == str(Path("relative/dir").resolve())


def test_rayservice_carries_the_gpu_funnel_and_autoscales():
    service = yaml.safe_load((DEPLOYMENTS / "rayservice.yaml").read_text())
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert serve_config == yaml.safe_load((DEPLOYMENTS / "funnel-gpu.yaml").read_text())
    assert unknown_keys(serve_config, ServeDeploySchema) == []
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    gpu = groups["gpu"]
    assert gpu["minReplicas"] == 0 and gpu["maxReplicas"] >= 1
    (container,) = gpu["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    env = {e["name"] for e in container["env"]}
    token_env = serve_config["applications"][0]["args"]["auth_token_env"]
    assert token_env in env  # the bearer token reaches the replicas


def test_the_config_check_refuses_what_serve_would_accept(tmp_path, capsys):
    """A user_config Serve would hand to running replicas (which keep their limits and log it), an unknown
    deployment, a typo in args: each refused by `python -m genrec.serving.check`, naming where."""
    config = yaml.safe_load((DEPLOYMENTS / "local.yaml").read_text())
    (app,) = config["applications"]
    app["args"]["max_replicaz"] = 2
    app["deployments"] += [
        {"name": "EngineServer", "user_config": {"max_queue": 0}},
        {"name": "Ingress", "user_config": {"request_timeout_s": -1, "deadline": 3}},
        {"name": "Engine"},
    ]
    found = problems(config)
    assert any(p.startswith("applications[0].args.max_replicaz:") for p in found)
    assert any(p.startswith("applications[0].deployments[1].user_config.max_queue:") for p in found)
    assert any(p.startswith("applications[0].deployments[2].user_config.request_timeout_s:") for p in found)
    assert any(p.startswith("applications[0].deployments[2].user_config.deadline:") for p in found)
    assert any(p.startswith("applications[0].deployments[3].name: no deployment 'Engine'") for p in found)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main([str(path)]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == len(found) and all(e.startswith(f"error: {path}: ") for e in errors)
    assert main([str(DEPLOYMENTS / "rayservice.yaml")]) == 0  # a RayService is read through its serveConfigV2


def test_the_config_check_can_check_the_model_directory(tiny_dir, tmp_path):
    config = yaml.safe_load((DEPLOYMENTS / "local.yaml").read_text())
    config["applications"][0]["args"]["model_dir"] = str(tiny_dir)
    assert problems(config, check_model=True) == []
    config["applications"][0]["args"]["model_dir"] = str(tmp_path / "no-such-model")
    (problem,) = problems(config, check_model=True)
    assert problem.startswith("applications[0].args.model_dir: ") and "does not exist" in problem


@pytest.mark.parametrize("path", FUNNELS, ids=lambda p: p.name)
def test_a_funnels_ranker_is_a_second_engine_deployment_scaled_on_its_own(path):
    from genrec.serving.app import engine_deployment

    (app,) = yaml.safe_load(path.read_text())["applications"]
    args = AppArgs.model_validate(app["args"])
    retriever, ranker = engine_deployment(args), engine_deployment(args, args.ranker)
    assert ranker["autoscaling_config"]["max_replicas"] == args.ranker.max_replicas
    assert ranker["ray_actor_options"]["num_cpus"] == args.ranker.engine_num_cpus
    assert ranker["request_router_config"] == retriever["request_router_config"]
    if args.device == "cuda":  # a GPU node hosts a replica of each
        assert retriever["ray_actor_options"]["num_gpus"] + ranker["ray_actor_options"]["num_gpus"] <= 1
    else:  # fractions: a 2-core laptop runs both engines, the ingress and the proxy
        assert retriever["ray_actor_options"]["num_cpus"] + ranker["ray_actor_options"]["num_cpus"] < 1


def test_the_config_check_knows_the_ranker(tiny_dir, hstu_dir):
    config = yaml.safe_load((DEPLOYMENTS / "funnel-local.yaml").read_text())
    (app,) = config["applications"]
    app["args"]["model_dir"], app["args"]["ranker"]["model_dir"] = str(tiny_dir), str(hstu_dir)
    assert problems(config, check_model=True) == []
    app["args"]["model_dir"], app["args"]["ranker"]["model_dir"] = str(hstu_dir), str(hstu_dir)
    (problem,) = problems(config, check_model=True)
    assert problem.startswith("applications[0].args.model_dir: ") and "Qwen3" in problem
    app["args"]["model_dir"], app["args"]["ranker"]["model_dir"] = str(tiny_dir), str(tiny_dir)
    (problem,) = problems(config, check_model=True)
    assert problem.startswith("applications[0].args.ranker.model_dir: ") and "HSTU" in problem
    app["args"]["ranker"]["max_replicaz"] = 2
    assert any(p.startswith("applications[0].args.ranker.max_replicaz:") for p in problems(config))
    del app["args"]["ranker"]  # without a ranker, a RankerServer block names no deployment of the app
    assert any("deployments[1].name: no deployment 'RankerServer'" in p for p in problems(config))
