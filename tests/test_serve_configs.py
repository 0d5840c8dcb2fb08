"""The Serve config files: every key is one Serve's schema defines (Serve drops unknown keys silently, so a
typo would deploy and do nothing), `args` validate into AppArgs, and every named deployment exists."""

import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel
from ray.serve.schema import ServeDeploySchema

from genrec.serving.app import build_app
from genrec.serving.args import AppArgs, EngineLimits, IngressLimits

DEPLOYMENTS = Path(__file__).resolve().parents[1] / "deployments"
CONFIGS = [DEPLOYMENTS / "local.yaml", DEPLOYMENTS / "gpu.yaml", DEPLOYMENTS / "hstu-local.yaml"]
FREE_FORM = {"args", "user_config", "runtime_env", "env_vars", "resources"}  # dicts Serve passes through


def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation may hold (through Optional, Union, list, dict values)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found = []
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def unknown_keys(value, model: type[BaseModel], path: str = "") -> list[str]:
    if isinstance(value, list):
        return [bad for i, item in enumerate(value) for bad in unknown_keys(item, model, f"{path}[{i}]")]
    if not isinstance(value, dict):
        return []
    fields = {f.alias or name: f for name, f in model.model_fields.items()} | dict(model.model_fields)
    bad = []
    for key, item in value.items():
        where = f"{path}.{key}" if path else key
        if key not in fields:
            bad.append(where)
        elif key not in FREE_FORM:
            for sub in _models_in(fields[key].annotation):
                bad += unknown_keys(item, sub, where)
    return bad


def deployment_names(app) -> set[str]:
    from ray.serve._private.build_app import build_app as flatten

    return {d.name for d in flatten(app, name="check").deployments}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_keys_are_serve_schema_fields(path):
    config = yaml.safe_load(path.read_text())
    assert unknown_keys(config, ServeDeploySchema) == []
    ServeDeploySchema.model_validate(config)  # and the values validate


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_args_and_deployment_names_match_the_app(path):
    for application in yaml.safe_load(path.read_text())["applications"]:
        assert application["import_path"] == "genrec.serving.app:build_app"
        args = AppArgs.model_validate(application["args"])
        names = deployment_names(build_app(args))
        assert names == {"Ingress", "EngineServer"}
        assert {d["name"] for d in application.get("deployments", [])} <= names
        live = {"Ingress": IngressLimits, "EngineServer": EngineLimits}
        for deployment in application.get("deployments", []):
            if "user_config" in deployment:  # what reconfigure() will be handed
                live[deployment["name"]].model_validate(deployment["user_config"])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_engine_deployment_routes_by_user(path):
    """The config names genrec's user router (a request_router_config without the class would select Serve's
    default) with kwargs it accepts, and the class loads as a Serve RequestRouter."""
    from ray.serve.config import RequestRouterConfig
    from ray.serve.request_router import RequestRouter

    from genrec.serving.router import USER_ROUTER, UserRouter

    for application in yaml.safe_load(path.read_text())["applications"]:
        (engine,) = [d for d in application["deployments"] if d["name"] == "EngineServer"]
        config = RequestRouterConfig(**engine["request_router_config"])  # imports the class
        assert config.request_router_class == USER_ROUTER
        assert issubclass(UserRouter, RequestRouter)
        UserRouter.__new__(UserRouter).initialize_state(**config.request_router_kwargs)


def test_the_gpu_app_keeps_two_engine_replicas_and_their_caches_through_a_dip():
    (application,) = yaml.safe_load((DEPLOYMENTS / "gpu.yaml").read_text())["applications"]
    args = AppArgs.model_validate(application["args"])
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


def test_rayservice_carries_the_gpu_app_and_autoscales():
    service = yaml.safe_load((DEPLOYMENTS / "rayservice.yaml").read_text())
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert serve_config == yaml.safe_load((DEPLOYMENTS / "gpu.yaml").read_text())
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
