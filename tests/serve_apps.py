"""Serve apps for the test modules, deployed on the session's Serve as `serve deploy` does (from a config naming
the builder), so a change of `user_config` alone reconfigures running replicas instead of replacing them."""

import time

from genrec.serving.args import AppArgs

SMALL = {"retriever": 0.2, "ranker": 0.2, "ingress": 0.05}  # CPUs a replica reserves: apps share 2 test CPUs

# A config is declarative (apps it leaves out are removed): every deploy lists every app the session runs.
_DEPLOYED: dict[str, dict] = {}


def deploy(name: str, deployments: list[dict] | None = None, **args) -> None:
    deploy_many({name: (deployments, args)})


def deploy_many(apps: dict[str, tuple[list[dict] | None, dict]], timeout_s: float = 400) -> None:
    """Several apps in one config: Serve starts them side by side. Waits up to `timeout_s` for them to run (not
    Serve's own 60 s: on a loaded 2-core machine apps of several replicas take longer; under pytest-timeout's
    600 s, so a slow start fails with this message) and for the proxy actors to answer."""
    from ray.serve.context import _get_global_client

    for name, (deployments, args) in apps.items():
        _record(name, deployments, args)
    _apply()  # returns once the controller has taken the config: the apps read DEPLOYING, not a stale RUNNING
    deadline = time.monotonic() + timeout_s
    while (statuses := _statuses(list(apps))) and set(statuses.values()) != {"RUNNING"}:
        assert "DEPLOY_FAILED" not in statuses.values(), statuses
        assert time.monotonic() < deadline, f"not running after {timeout_s:g} s: {statuses}"
        time.sleep(0.5)
    _get_global_client().wait_for_proxies_serving(wait_for_applications_running=True)


def deploy_started(name: str, deployments: list[dict] | None = None, **args) -> None:
    """Send the app's new config and return once the controller has it, without waiting for it to run (a version
    that never runs: e.g. a ranker no node can host)."""
    _record(name, deployments, args)
    _apply()


def deployment_states(app: str) -> dict[str, dict[str, int]]:
    """Each deployment's replicas by state (RUNNING, STARTING, STOPPING...)."""
    from ray import serve

    found = serve.status().applications.get(app)
    return {name: dict(d.replica_states) for name, d in found.deployments.items()} if found else {}


def _statuses(names: list[str]) -> dict[str, str | None]:
    from ray import serve

    found = serve.status().applications
    return {name: found[name].status if name in found else None for name in names}


def deploy_refused(name: str, deployments: list[dict] | None = None, timeout_s: float = 180, **args) -> str:
    """Deploy a config the app's builder refuses and return the app's DEPLOY_FAILED message (its running version
    stays). The refused config stays recorded: deploy the good one again afterwards."""
    from ray import serve

    _record(name, deployments, args)
    _apply()
    deadline = time.monotonic() + timeout_s
    while (status := serve.status().applications[name]).status != "DEPLOY_FAILED":
        assert time.monotonic() < deadline, f"the deploy of {name} was not refused: {status.status}"
        time.sleep(0.2)
    return status.message


def small(args: dict) -> dict:
    """The app's sections, each replica reserving a small share of a CPU unless the test says otherwise."""
    out = {"ingress": {}} | args
    for section, cpus in SMALL.items():
        if out.get(section) is not None:
            deployment = out[section].get("deployment", {})
            actor = {"num_cpus": cpus} | deployment.get("ray_actor_options", {})
            out[section] = out[section] | {"deployment": deployment | {"ray_actor_options": actor}}
    return out


def _record(name: str, deployments: list[dict] | None, args: dict) -> None:
    AppArgs(**small(args))  # fail here, readably, on a typo in a test
    _DEPLOYED[name] = {
        "name": name,
        "route_prefix": f"/{name}",
        "import_path": "genrec.serving.app:build_app",
        "args": small(args),
        "deployments": deployments or [],
    }


def _apply() -> None:
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema(applications=list(_DEPLOYED.values())))


def delete(name: str) -> None:
    """Delete the app without waiting for its replicas to stop (~3 s each: Serve's graceful shutdown loop); the next
    config sent leaves it out, and no test deploys a deleted app's name again."""
    from ray import serve

    _DEPLOYED.pop(name)
    serve.delete(name, _blocking=False)


def replica_actor_names(app: str, deployment: str) -> list[str]:
    import ray

    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::") and f"{app}#{deployment}#" in a["name"]
    )


def sticky(*deployment_names: str) -> list[dict]:
    """Deployment overrides for tests that assert where the user router sends a request: spill to the fallback
    only after 30 s (the default 0.1 s lets one slow queue-length probe on a loaded machine move a request;
    spilling has its own tests)."""
    from genrec.serving.router import USER_ROUTER

    router = {"request_router_class": USER_ROUTER, "request_router_kwargs": {"spill_after_s": 30}}
    return [{"name": name, "request_router_config": router} for name in deployment_names]


def wait_for(predicate, what: str, timeout_s: float = 60):
    """What `predicate()` returns once it is truthy, asked every half second for up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (found := predicate()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.5)
    return found
