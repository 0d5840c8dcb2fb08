"""The Serve config files: every key is one Serve's schema defines (Serve drops unknown keys silently, so a
typo would deploy and do nothing), `args` validate into AppArgs, and every named deployment exists."""

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from genrec.serving.app import application
from genrec.serving.args import DEPLOYMENTS as ENGINE_DEPLOYMENTS
from genrec.serving.args import AppArgs, EngineLimits, IngressLimits, unknown_keys
from genrec.serving.check import Findings, deployments_of, findings, main, problems
from genrec.serving.config_yaml import read_yaml

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
        engines = {ENGINE_DEPLOYMENTS[name] for name in args.engines()}
        assert names == {"Ingress"} | engines == set(deployments_of(app["args"]))  # the check's
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
        assert len(engines) == len(AppArgs.model_validate(app["args"]).engines())  # a funnel's ranker too
        for engine in engines:
            config = RequestRouterConfig(**engine["request_router_config"])  # imports the class
            assert config.request_router_class == USER_ROUTER
            assert issubclass(UserRouter, RequestRouter)
            UserRouter.__new__(UserRouter).initialize_state(**config.request_router_kwargs)


def test_the_gpu_app_keeps_two_engine_replicas_and_their_caches_through_a_dip():
    (app,) = yaml.safe_load((DEPLOYMENTS / "gpu.yaml").read_text())["applications"]
    args = AppArgs.model_validate(app["args"])
    scaling = args.retriever.deployment["autoscaling_config"]
    assert scaling["min_replicas"] >= 2 and scaling["downscale_delay_s"] >= 600
    from genrec.serving.app import engine_deployment

    deployed = engine_deployment(args, args.retriever)["autoscaling_config"]
    assert deployed["downscale_delay_s"] == scaling["downscale_delay_s"]


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
        AppArgs.model_validate({"retriever": {"model_dirr": "/m"}})
    with pytest.raises(ValidationError, match="max_replicas"):
        scaling = {"autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}
        AppArgs.model_validate({"retriever": {"model_dir": "/m", "deployment": scaling}})
    relative = AppArgs.model_validate({"retriever": {"model_dir": "relative/dir"}})
    assert relative.retriever.model_dir == str(Path("relative/dir").resolve())


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
    token_env = serve_config["applications"][0]["args"]["ingress"]["auth_token_env"]
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
    config["applications"][0]["args"]["retriever"]["model_dir"] = str(tiny_dir)
    assert problems(config, check_model=True) == []
    config["applications"][0]["args"]["retriever"]["model_dir"] = str(tmp_path / "no-such-model")
    (problem,) = problems(config, check_model=True)
    assert problem.startswith("applications[0].args.retriever.model_dir: ") and "does not exist" in problem


def test_the_config_check_loads_a_catalog_the_user_config_names(tiny_dir, tmp_path):
    """A catalog the replicas would refuse (keeping the running one) is refused before the deploy instead."""
    import shutil

    config = yaml.safe_load((DEPLOYMENTS / "local.yaml").read_text())
    (app,) = config["applications"]
    app["args"]["retriever"]["model_dir"] = str(tiny_dir)
    engine = next(d for d in app["deployments"] if d["name"] == "EngineServer")
    shutil.copy(tiny_dir / "genrec/catalog.parquet", tmp_path / "next.parquet")
    engine["user_config"] = {"catalog": str(tmp_path / "next.parquet")}
    assert problems(config, check_model=True) == []
    engine["user_config"] = {"catalog": "catalogs/missing.parquet"}  # relative to the model directory
    (problem,) = problems(config, check_model=True)
    assert problem.startswith("applications[0].deployments[") and ".user_config.catalog: " in problem
    assert "catalogs/missing.parquet" in problem and "missing" in problem
    engine["user_config"] = {"catalog": ""}
    (problem,) = problems(config, check_model=False)
    assert ".user_config.catalog: " in problem


@pytest.mark.parametrize("path", FUNNELS, ids=lambda p: p.name)
def test_a_funnels_ranker_is_a_second_engine_deployment_scaled_on_its_own(path):
    from genrec.serving.app import engine_deployment

    (app,) = yaml.safe_load(path.read_text())["applications"]
    args = AppArgs.model_validate(app["args"])
    retriever, ranker = engine_deployment(args, args.retriever), engine_deployment(args, args.ranker)
    own = args.ranker.deployment
    assert ranker["autoscaling_config"]["max_replicas"] == own["autoscaling_config"]["max_replicas"]
    assert ranker["ray_actor_options"]["num_cpus"] == own["ray_actor_options"]["num_cpus"]
    assert ranker["request_router_config"] == retriever["request_router_config"]
    if args.retriever.device == "cuda":  # a GPU node hosts a replica of each
        assert retriever["ray_actor_options"]["num_gpus"] + ranker["ray_actor_options"]["num_gpus"] <= 1
    else:  # fractions: a 2-core laptop runs both engines, the ingress and the proxy
        assert retriever["ray_actor_options"]["num_cpus"] + ranker["ray_actor_options"]["num_cpus"] < 1


def test_the_config_check_knows_the_ranker(tiny_dir, hstu_dir):
    config = yaml.safe_load((DEPLOYMENTS / "funnel-local.yaml").read_text())
    (app,) = config["applications"]
    retriever, ranker = app["args"]["retriever"], app["args"]["ranker"]
    retriever["model_dir"], ranker["model_dir"] = str(tiny_dir), str(hstu_dir)
    assert problems(config, check_model=True) == []
    retriever["model_dir"], ranker["model_dir"] = str(hstu_dir), str(hstu_dir)
    (problem,) = problems(config, check_model=True)
    assert problem.startswith("applications[0].args.retriever.model_dir: ") and "Qwen3" in problem
    retriever["model_dir"], ranker["model_dir"] = str(tiny_dir), str(tiny_dir)
    (problem,) = problems(config, check_model=True)
    assert problem.startswith("applications[0].args.ranker.model_dir: ") and "HSTU" in problem
    app["args"]["ranker"]["max_replicaz"] = 2
    assert any(p.startswith("applications[0].args.ranker.max_replicaz:") for p in problems(config))
    del app["args"]["ranker"]  # without a ranker, a RankerServer block names no deployment of the app
    assert any("deployments[1].name: no deployment 'RankerServer'" in p for p in problems(config))


def test_args_in_the_flat_form_of_earlier_releases_are_refused_by_name(tmp_path, capsys):
    """The flat form (model_dir, engine_num_cpus... at the top) is gone (docs/CHANGELOG.md): its keys are refused
    by name, by the builder's validation and by the check (exit 2), never read as something else."""
    from pydantic import ValidationError

    flat = {"model_dir": "/m", "engine_num_cpus": 0.5, "ingress_replicas": 2}
    with pytest.raises(ValidationError) as err:
        AppArgs.model_validate(flat)
    assert {e["loc"][0] for e in err.value.errors() if e["type"] == "extra_forbidden"} == set(flat)
    config = yaml.safe_load((DEPLOYMENTS / "funnel-local.yaml").read_text())
    config["applications"][0]["args"] = flat
    path = tmp_path / "flat.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main([str(path)]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert all(line.startswith(f"error: {path}: applications[0]") for line in errors)
    for key in flat:
        assert any(f"applications[0].args.{key}: Extra inputs are not permitted" in line for line in errors), key


def test_a_section_refuses_serve_options_it_does_not_pass_through():
    from pydantic import ValidationError

    for options, fragment in (
        ({"num_replica": 2}, "num_replica: not an option of a Serve deployment"),
        ({"user_config": {"max_queue": 3}}, "it is the section's `limits`"),
        ({"name": "Mine"}, "the deployment's name is genrec's"),
    ):
        with pytest.raises(ValidationError, match=fragment):
            AppArgs.model_validate({"retriever": {"model_dir": "/m", "deployment": options}})
    with pytest.raises(ValidationError, match="needs a retriever"):
        AppArgs.model_validate({"ingress": {}})


def test_every_deployment_starts_its_replacements_before_it_stops_the_old_unless_told_not_to():
    """A rolling restart surges (a one-replica engine never has none running); a section's `max_surge_percent`
    wins, e.g. 0 on a cluster with no room for an extra GPU replica."""
    from genrec.serving.app import engine_deployment
    from genrec.serving.args import ROLLOUT_SURGE_PERCENT

    args = AppArgs.model_validate(
        {"retriever": {"model_dir": "/m"}, "ranker": {"model_dir": "/h", "deployment": {"max_surge_percent": 0}}}
    )
    assert ROLLOUT_SURGE_PERCENT > 0
    assert args.ingress.deployment_options(args.ingress.defaults())["max_surge_percent"] == ROLLOUT_SURGE_PERCENT
    assert engine_deployment(args, args.retriever)["max_surge_percent"] == ROLLOUT_SURGE_PERCENT
    assert engine_deployment(args, args.ranker)["max_surge_percent"] == 0


GPU_CONFIGS = [DEPLOYMENTS / "gpu.yaml", DEPLOYMENTS / "funnel-gpu.yaml"]


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_the_gpu_engines_scale_on_their_work_with_a_policy_that_loads(path):
    """Each engine deployment names genrec's work policy (not Serve's request count), by an import path that
    imports and kwargs it takes, as the controller will load and build it."""
    from ray.serve.config import AutoscalingConfig

    from genrec.serving.app import engine_deployment
    from genrec.serving.autoscaling import WORK_POLICY, WorkPolicy

    (app,) = yaml.safe_load(path.read_text())["applications"]
    args = AppArgs.model_validate(app["args"])
    for section in args.engines().values():
        deployed = AutoscalingConfig(**engine_deployment(args, section)["autoscaling_config"])
        assert deployed.policy.policy_function == WORK_POLICY
        loaded = deployed.policy.get_policy()  # what the controller unpickles and builds with the kwargs
        assert loaded.__qualname__ == WorkPolicy.__qualname__
        assert loaded(**deployed.policy.policy_kwargs).target > 0


def test_the_config_check_refuses_a_policy_the_controller_could_not_load_or_build(tmp_path, capsys):
    """Serve imports the policy and builds it with its kwargs in its controller, after the config was sent: a bad
    path or a kwarg the policy does not take is refused before anything is sent, naming where."""
    config = yaml.safe_load((DEPLOYMENTS / "gpu.yaml").read_text())
    policy = config["applications"][0]["args"]["retriever"]["deployment"]["autoscaling_config"]["policy"]
    where = "applications[0].args.retriever.deployment"
    for bad, says in (
        ({"policy_function": "genrec.serving.autoscaling:WorkPolicyy"}, "autoscaling_config.policy.policy_function"),
        ({"policy_function": "genrec.serving.no_such_module:WorkPolicy"}, "cannot import"),
        ({"policy_kwargs": {"target_work": 64000}}, "autoscaling_config.policy.policy_kwargs"),
        ({"policy_kwargs": {"target_work_per_replica": 0}}, "must be positive"),
    ):
        broken = {**policy, **bad}
        config["applications"][0]["args"]["retriever"]["deployment"]["autoscaling_config"]["policy"] = broken
        (problem,) = problems(config)
        assert problem.startswith(f"{where}: ") and says in problem, problem
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main([str(path)]) == 2
    assert "policy_kwargs" in capsys.readouterr().err


def test_the_rayservice_upgrade_strategy_is_one_kuberay_knows():
    spec = yaml.safe_load((DEPLOYMENTS / "rayservice.yaml").read_text())["spec"]
    strategy = spec["upgradeStrategy"]
    assert strategy["type"] in ("NewCluster", "NewClusterWithIncrementalUpgrade")
    if strategy["type"] == "NewClusterWithIncrementalUpgrade":  # its required options (KubeRay 1.5.1+)
        options = strategy["clusterUpgradeOptions"]
        assert {"gatewayClassName", "stepSizePercent", "intervalSeconds"} <= set(options)
        assert options["stepSizePercent"] <= options.get("maxSurgePercent", 100)
        assert spec["rayClusterConfig"]["enableInTreeAutoscaling"] is True


def test_what_a_careless_operator_wrote_is_refused_by_field_without_a_traceback(tmp_path):
    """Found by a careless-operator probe of `genrec deploy` (each passed, or raised a traceback, before):"""
    from genrec.serving.check import dashboard_silence, file_problems

    def local(edit) -> list[str]:
        config = yaml.safe_load((DEPLOYMENTS / "local.yaml").read_text())
        edit(config["applications"][0])
        return problems(config)

    def dotted(app):  # Serve imports `module.attr` as `module:attr`: genrec's checks were all skipped
        app["import_path"] = "genrec.serving.app.build_app"
        app["args"]["bogus"] = 1

    assert any(p.startswith("applications[0].args.bogus:") for p in local(dotted))
    typo = local(lambda app: app.update(import_path="genrec.serving.app:build_ap"))
    assert typo == ["applications[0].import_path: 'genrec.serving.app:build_ap' is not genrec's app builder "
                    "(genrec.serving.app:build_app)"]  # fmt: skip
    assert problems({"applications": []}) == [
        "applications: empty: serve deploy would delete every app running on the cluster"
    ]
    # A live deadline past the ingress's drain: every replica refused it and kept its own.
    late = local(lambda app: app["deployments"].append({"name": "Ingress", "user_config": {"request_timeout_s": 1000}}))
    assert any(p.startswith("applications[0].deployments[1].user_config.request_timeout_s: request_timeout_s 1000 "
                            "needs the ingress's graceful_shutdown_timeout_s") for p in late), late  # fmt: skip
    for field in ("request_timeout_s", "body_timeout_s", "funnel_reserve_s"):  # NaN was refused, infinity not
        section = "limits" if field == "request_timeout_s" else None
        edit = {field: float("inf")} if section is None else {section: {field: float("inf")}}
        found = local(lambda app, e=edit: app["args"].setdefault("ingress", {}).update(e))
        assert any(f"ingress.{section + '.' if section else ''}{field}:" in p for p in found), found
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    found = local(lambda app: app["args"]["retriever"].update(model_dir=str(loop)))
    assert any(p.startswith("applications[0].args.retriever.model_dir:") and "cannot be resolved" in p for p in found)
    router = {"name": "EngineServer", "request_router_config": {"request_router_class": "nope:Nope"}}
    found = local(lambda app: app["deployments"].append(router))
    assert any("cannot be imported here (ModuleNotFoundError" in p for p in found), found
    gpu = local(lambda app: app["args"]["retriever"].update(device="cuda", deployment={"ray_actor_options": {
        "num_gpus": 0}}))  # fmt: skip
    assert any(p.startswith("applications[0].args.retriever:") and "num_gpus > 0" in p for p in gpu), gpu
    for name in ("", "A=B"):  # no variable can have such a name: every ingress replica failed to start
        found = local(lambda app, n=name: app["args"].setdefault("ingress", {}).update(auth_token_env=n))
        assert any(p.startswith("applications[0].args.ingress.auth_token_env:") for p in found), found
    service = tmp_path / "service.yaml"
    service.write_text(yaml.safe_dump({"kind": "RayService", "spec": {"serveConfigV2": {"applications": []}}}))
    assert any("spec.serveConfigV2: a RayService carries its Serve config as a YAML string" in p
               for p in file_problems(service))  # fmt: skip
    assert "serve deploy sends the config to the Ray dashboard" in dashboard_silence("ray://127.0.0.1:10001")
    assert "does not answer" in dashboard_silence("http://127.0.0.1:1 x", timeout_s=1)


def test_a_key_or_a_deployment_given_twice_is_refused_with_where(tmp_path):
    """YAML keeps a repeated key's last value, and Serve applies a deployment listed twice field over field, both
    without a word: an operator's second `num_replicas` replaced the first. Each is refused, naming where."""
    from genrec.serving.check import file_problems

    text = (DEPLOYMENTS / "local.yaml").read_text()
    twice = tmp_path / "twice.yaml"
    twice.write_text(text + "\nproxy_location: Disabled\n")  # local.yaml sets it at its top
    (refusal,) = file_problems(twice)
    assert "key 'proxy_location' given twice, on lines 3 and " in refusal and "\n" not in refusal, refusal
    anchors = tmp_path / "anchors.yaml"  # merge keys repeat by design: not a duplicate
    anchors.write_text("base: &b {x: 1}\nother: &o {y: 2}\nmerged:\n  <<: *b\n  <<: *o\n")
    assert read_yaml(anchors.read_text())["merged"] == {"x": 1, "y": 2}
    # A mapping that overrides a key it merged, reached again through an alias (merging rewrote it in place).
    assert read_yaml("a: &a {x: 1}\nc: {<<: &b {<<: *a, x: 2}}\nd: *b\n")["d"] == {"x": 2}
    colliding = {"~: 1\nnull: 2\n": "null", "2026-12-07: a\n2026-12-07: b\n": "2026-12-07", "1: a\n1.0: b\n": "1.0"}
    for document, key in colliding.items():
        with pytest.raises(yaml.YAMLError, match=f"key '{key}' given twice, on lines 1 and 2"):
            read_yaml(document)  # keys that are not strings collide too (the second as written)
    baddate = tmp_path / "baddate.yaml"  # shaped like a date and none: refused with its line, a date kept
    baddate.write_text(text + "\nnot_a_day: 2026-13-45\n")
    (refusal,) = file_problems(baddate)
    line = len((text + "\n").splitlines()) + 1
    assert f"'2026-13-45' on line {line} is no date: month must be in 1..12" in refusal and "\n" not in refusal
    assert str(read_yaml("when: 2026-12-07\n")["when"]) == "2026-12-07"
    service = tmp_path / "service.yaml"  # the inner config's lines count from its string: say where they are
    service.write_text(yaml.safe_dump({"kind": "RayService", "spec": {"serveConfigV2": "a: 1\na: 2\n"}}))
    (refusal,) = file_problems(service)
    assert "spec.serveConfigV2: key 'a' given twice, on lines 1 and 2" in refusal, refusal
    config = yaml.safe_load(text)
    app = config["applications"][0]
    app["deployments"] = [{"name": "Ingress", "num_replicas": 2}, {"name": "Ingress", "num_replicas": 1}]
    assert problems(config) == ["applications[0].deployments[1].name: 'Ingress' is listed twice (also "
                                "applications[0].deployments[0]): merge them"]  # fmt: skip
    app["deployments"] = [{"name": ["Ingress"]}]  # a name that is not a string: a TypeError (unhashable) before
    assert problems(config) == ["applications.0.deployments.0.name: Input should be a valid string"]
    app["deployments"] = ["Ingress", {"name": "Ingress"}, None]  # Serve's own schema raised an AttributeError on them
    assert problems(config) == [
        "applications[0].deployments[0]: a deployment is a mapping (name, num_replicas, ...), not str",
        "applications[0].deployments[2]: a deployment is a mapping (name, num_replicas, ...), not null",
    ]


def test_without_the_model_a_directory_of_the_other_family_or_a_bad_config_json_is_refused(
    tiny_dir, hstu_dir, tmp_path
):
    """Without `--model` (no torch on the deploying machine), each engine section's config.json is still read where
    its directory is readable here: a ranker's directory under `retriever` was sent, and every replica failed."""
    config = yaml.safe_load((DEPLOYMENTS / "local.yaml").read_text())
    retriever = config["applications"][0]["args"]["retriever"]

    def found(model_dir) -> list[str]:
        retriever["model_dir"] = str(model_dir)
        return [p for p in problems(config) if ".model_dir:" in p]

    assert found(tiny_dir) == [] and found(tmp_path / "not-here") == []  # absent here: left to the builder
    assert found(hstu_dir) == [f"applications[0].args.retriever.model_dir: {hstu_dir} is an HSTU ranking model, not a "
                               "Qwen3 semantic-ID model: put it under `ranker`"]  # fmt: skip
    broken = tmp_path / "broken"
    broken.mkdir()
    assert found(broken) == [f"applications[0].args.retriever.model_dir: {broken}: config.json is missing"]
    (broken / "config.json").write_text("{")
    (problem,) = found(broken)
    assert (
        problem.startswith("applications[0].args.retriever.model_dir:") and "config.json is not valid JSON" in problem
    )
    (broken / "config.json").write_text('{"model_type": "qwen3", "hidden_size": 64}')  # validated as its family's
    (problem,) = found(broken)
    assert problem.startswith("applications[0].args.retriever.model_dir:") and "lacks vocab_size" in problem, problem
    (broken / "config.json").write_text("[" * 100_000)  # nested past Python's recursion limit
    assert "config.json is not valid JSON (RecursionError" in found(broken)[0]
    (broken / "config.json").unlink()
    os.mkfifo(broken / "config.json")  # read, it would hang the check
    assert found(broken) == [f"applications[0].args.retriever.model_dir: {broken}: config.json is not a file"]
    assert found(broken / "config.json") == [f"applications[0].args.retriever.model_dir: {broken / 'config.json'} is "
                                             "not a directory"]  # fmt: skip
    funnel = yaml.safe_load((DEPLOYMENTS / "funnel-local.yaml").read_text())
    funnel["applications"][0]["args"]["retriever"]["model_dir"] = str(tiny_dir)
    hstu = json.loads((hstu_dir / "config.json").read_text()) | {"model_type": "GENREC_HSTU"}
    near = tmp_path / "near"
    shutil.copytree(hstu_dir, near)
    (near / "config.json").write_text(json.dumps(hstu))
    funnel["applications"][0]["args"]["ranker"]["model_dir"] = str(near)
    assert [p for p in problems(funnel) if ".model_dir:" in p] == [
        f"applications[0].args.ranker.model_dir: {near} is a Qwen3 semantic-ID model, not an HSTU ranking model: put "
        "it under `retriever` (its config.json's model_type is 'GENREC_HSTU'; an HSTU ranker's is 'genrec_hstu')"
    ]


def test_a_ranker_directory_not_readable_here_is_a_partial_check_with_a_warning(tiny_dir, hstu_dir, tmp_path):
    """As a retriever's: its config.json is left to the builder's preflight, and the operator is told so."""
    funnel = yaml.safe_load((DEPLOYMENTS / "funnel-local.yaml").read_text())
    args = funnel["applications"][0]["args"]
    args["retriever"]["model_dir"], args["ranker"]["model_dir"] = str(tiny_dir), str(hstu_dir)
    assert findings(funnel) == Findings()
    elsewhere = tmp_path / "on-the-gpu-nodes-only"
    args["ranker"]["model_dir"] = str(elsewhere)
    assert findings(funnel) == Findings(warnings=[
        f"applications[0].args.ranker.model_dir: {elsewhere} is not readable here (it may exist only on the engine "
        "nodes): a partial check, its config.json was not checked"
    ])  # fmt: skip
