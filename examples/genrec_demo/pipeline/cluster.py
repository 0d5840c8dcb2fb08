"""A local Ray for the demo, and Serve on it with the app of a Serve config file (deployments/local.yaml).

Everything started here is stopped on the way out, on an error or Ctrl-C alike: shutting the local Ray
instance down takes Serve and the detached embedding-cache actors with it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import yaml

from genrec.errors import GenrecError


@contextmanager
def local_ray(num_cpus: int):
    """A new local Ray instance (never another one's): yields its address for the job processes."""
    os.environ["RAY_AUTH_MODE"] = "disabled"  # local runs; see notes on Ray's token auth
    import ray

    if ray.is_initialized():
        raise GenrecError("Ray is already initialised in this process; the demo starts its own local Ray")
    # address="local": a new instance even when RAY_ADDRESS names a cluster (the demo tears its Ray down).
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, namespace="genrec-demo")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()  # the whole local instance: Serve, the cache actors, every worker


def app_config(config_path: Path) -> dict:
    """The first application of a Serve config file, with the file's HTTP options and proxy location."""
    try:
        config = yaml.safe_load(config_path.read_text())
        app = config["applications"][0]
    except (OSError, yaml.YAMLError, KeyError, IndexError, TypeError) as err:
        raise GenrecError(f"{config_path}: not a Serve config with an application ({err})") from None
    return {**app, "http_options": config.get("http_options") or {}, "proxy_location": config.get("proxy_location")}


def port_or_free(port: int, chosen: bool = False) -> int:
    """`port` if nothing listens on it, else (or for 0) a free one: the demo never fights another server. A port the
    user `chosen` (--port) that is taken is refused instead: moving it would send their requests elsewhere."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            if port == 0:
                return s.getsockname()[1]
            return port
        except OSError as err:
            if chosen:
                raise GenrecError(f"--port {port}: cannot listen there ({err.strerror}); choose another, or leave "
                                  "--port out for the Serve config's (or a free one)") from None  # fmt: skip
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


class ServeApp:
    """The config's application on Serve, deployed as `serve deploy` deploys a config file (the controller's
    deploy_apps): a later deploy that changes a deployment's `user_config` alone reconfigures the running replicas
    in place (`deploy_catalog`)."""

    def __init__(self, config_path: Path, overrides: dict, port: int):
        from genrec.serving.args import AppArgs

        app = app_config(config_path)
        args = {**app.get("args", {}), **overrides}
        AppArgs.model_validate(args)  # a mistake here, readably, not in the controller's log
        self.http = {**app["http_options"], "host": "127.0.0.1", "port": port}
        self.proxy_location = app["proxy_location"]
        self.app = {k: v for k, v in app.items() if k not in ("http_options", "proxy_location")} | {"args": args}
        self.url = f"http://127.0.0.1:{port}{app.get('route_prefix', '/').rstrip('/')}"

    def start(self, timeout_s: float = 300.0) -> str:
        """Serve started with the config's HTTP options, the app deployed; its base URL once it answers."""
        from ray import serve

        serve.start(http_options=self.http, **({"proxy_location": self.proxy_location} if self.proxy_location else {}))
        self._deploy(self.app)
        _wait_healthy(f"{self.url}/healthz", timeout_s, self.app.get("name", "default"))
        return self.url

    def deploy_catalog(self, catalog: Path | None) -> None:
        """The same config with the retriever's `user_config` naming `catalog` (None: the model's own): what an
        operator's `serve deploy` of the edited file does. Returns once it is deployed (the replicas load it)."""
        deployments = [dict(d) for d in self.app.get("deployments", [])]
        engine = next((d for d in deployments if d.get("name") == "EngineServer"), None)
        if engine is None:
            engine = {"name": "EngineServer"}
            deployments.append(engine)
        live = {k: v for k, v in (engine.get("user_config") or {}).items() if k != "catalog"}
        engine["user_config"] = live | ({"catalog": str(catalog)} if catalog is not None else {})
        self._deploy(self.app | {"deployments": deployments})

    @staticmethod
    def _deploy(app: dict) -> None:
        from ray.serve.context import _get_global_client
        from ray.serve.schema import ServeDeploySchema

        _get_global_client().deploy_apps(ServeDeploySchema(applications=[app]))


def start_serve_app(config_path: Path, overrides: dict, port: int, timeout_s: float = 300.0) -> ServeApp:
    """Serve the config's application with `overrides` on its args; returns it once it answers (`.url`)."""
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the demo says what it starts
    app = ServeApp(config_path, overrides, port)
    app.start(timeout_s)
    return app


def _wait_healthy(url: str, timeout_s: float, name: str) -> None:
    """Until `url` answers ok; a deploy Serve gave up on (a replica's constructor raised, say) ends it at once, with
    Serve's reason, rather than after `timeout_s` with none."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                if json.loads(response.read()).get("status") == "ok":
                    return
        except OSError:
            pass
        failed = deploy_failure(name)
        if failed:
            raise GenrecError(f"the Serve app {name!r} failed to deploy: {failed}")
        if time.monotonic() > deadline:
            raise GenrecError(f"the Serve app did not become healthy within {timeout_s:.0f} s ({url})")
        time.sleep(0.5)


def deploy_failure(name: str, status=None) -> str | None:
    """Serve's reason when application `name`'s deploy failed (the last line of its message: a traceback's
    exception); None while it deploys or runs. `status`: a `serve.status()` already taken."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    app = (status or serve.status()).applications.get(name)
    if app is None or app.status != ApplicationStatus.DEPLOY_FAILED:
        return None
    lines = [line.strip() for line in app.message.splitlines() if line.strip()]
    return lines[-1] if lines else "no message"
