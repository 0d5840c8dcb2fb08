"""Serve apps for the test modules, deployed on the session's Serve as `serve deploy` does (from a config naming
the builder), so a change of `user_config` alone reconfigures running replicas instead of replacing them."""

from genrec.serving.args import AppArgs

SMALL = {"engine_num_cpus": 0.2, "ingress_num_cpus": 0.05}  # many apps share the 2-CPU test cluster

# A config is declarative (apps it leaves out are removed): every deploy lists every app the session runs.
_DEPLOYED: dict[str, dict] = {}


def deploy(name: str, deployments: list[dict] | None = None, **args) -> None:
    deploy_many({name: (deployments, args)})


def deploy_many(apps: dict[str, tuple[list[dict] | None, dict]]) -> None:
    """Several apps in one config: Serve starts them side by side."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    for name, (deployments, args) in apps.items():
        AppArgs(**(SMALL | args))  # fail here, readably, on a typo in a test
        _DEPLOYED[name] = {
            "name": name,
            "route_prefix": f"/{name}",
            "import_path": "genrec.serving.app:build_app",
            "args": SMALL | args,
            "deployments": deployments or [],
        }
    _get_global_client().deploy_apps(ServeDeploySchema(applications=list(_DEPLOYED.values())), _blocking=True)


def delete(name: str) -> None:
    from ray import serve

    _DEPLOYED.pop(name)
    serve.delete(name)


def replica_actor_names(app: str, deployment: str) -> list[str]:
    import ray

    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::") and f"{app}#{deployment}#" in a["name"]
    )
