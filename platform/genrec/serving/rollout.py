"""After `genrec deploy` sent a config: wait for its apps to run, then for each retriever's replicas to converge on the
declared catalog, and say which have not (docs/operations.md, "Deploy checks"). Serve reports a deploy done when its
replicas run, not when they serve what the config says (a replica may refuse its catalog, or not have loaded a file
changed in place yet: it converges within a check period and a load, declared_catalog.py), so each retriever's
replicas are read from its app's GET /v1/model, through Serve's HTTP proxy on the dashboard's host.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.parse
import urllib.request

from pydantic import ValidationError

from genrec.errors import GenrecError
from genrec.serving.args import DEPLOYMENTS, AppArgs, catalog_file

DEPLOY_WAIT_S = 600.0  # an app of many GPU replicas can take minutes to start
POLL_S = 1.0
REPORTED_WITHIN_S = 15.0  # replicas report to the board on every change and every few seconds (replicas.py)
CONVERGED_WITHIN_S = 30.0  # a replica's check period, its load of the catalog and its next report, with room
HTTP_TIMEOUT_S = 10.0


def wait_and_report(config: dict, dashboard: str, is_builder, where: str) -> int:
    """0: every app runs and every retriever replica serves its declared catalog; else 1, a stderr line each.
    `is_builder`: whether an import path is genrec's app builder."""
    apps = [a for a in config.get("applications", []) if isinstance(a, dict)]
    try:
        details, problems = _running(dashboard, [a["name"] for a in apps])
    except (OSError, ValueError) as err:  # the dashboard stopped answering
        details, problems = {}, [("error", f"deployed, but the dashboard at {dashboard} did not say how ({err})")]
    for app in apps if not problems else []:
        if is_builder(app.get("import_path")):
            problems += _catalog_problems(app, details, dashboard)
    for problem in problems:
        print(f"{problem[0]}: {where}: {problem[1]}", file=sys.stderr)
    return 1 if any(kind == "error" for kind, _ in problems) else 0


def _running(dashboard: str, names: list[str]) -> tuple[dict, list[tuple[str, str]]]:
    """The dashboard's Serve details once every named app is RUNNING; else the apps that failed or did not run."""
    deadline = time.monotonic() + DEPLOY_WAIT_S
    while True:
        details = _get_json(f"{dashboard.rstrip('/')}/api/serve/applications/")
        statuses = {name: details.get("applications", {}).get(name, {}) for name in names}
        failed = [(n, s) for n, s in statuses.items() if s.get("status") in ("DEPLOY_FAILED", "UNHEALTHY")]
        if failed:
            return details, [("error", f"{n}: {s['status']}: {s.get('message', '')}".strip()) for n, s in failed]
        if all(s.get("status") == "RUNNING" for s in statuses.values()):
            return details, []
        if time.monotonic() > deadline:
            late = ", ".join(f"{n} {s.get('status', 'absent')}" for n, s in statuses.items())
            return details, [("error", f"not running after {DEPLOY_WAIT_S:g} s: {late}")]
        time.sleep(POLL_S)


def _catalog_problems(app: dict, details: dict, dashboard: str) -> list[tuple[str, str]]:
    """One line per running retriever replica of the app that has not converged on the declared catalog within
    CONVERGED_WITHIN_S."""
    try:
        args = AppArgs.model_validate(app.get("args") or {})
    except ValidationError:
        return []  # the builder validated them on the cluster: this machine cannot (e.g. paths)
    if args.retriever is None:
        return []
    name, engine = app["name"], DEPLOYMENTS["retriever"]
    declared = _user_config(app, engine).get("catalog")
    version = _declared_version(args.retriever.model_dir, declared)
    running = _running_replicas(details, name, engine)
    deadline = time.monotonic() + CONVERGED_WITHIN_S
    while True:
        try:
            reported = _reported(app_url(dashboard, details, name), args.ingress.auth_token_env, running)
        except (OSError, ValueError) as err:  # URLError, HTTP errors, timeouts, a body that is not JSON
            return [("warning", f"{name}: could not ask the app which catalog its replicas serve ({err})")]
        problems = [p for replica in running if (p := _replica_problem(name, replica, reported, version))]
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(POLL_S)


def _replica_problem(app: str, replica: str, reported: dict, version: str | None) -> tuple[str, str] | None:
    state = reported.get(replica)
    if state is None:
        return "error", f"{app}: replica {replica} has not reported its catalog"
    since = _since(state.get("catalog_not_declared_since"))
    if state.get("catalog_status") != "declared":
        why = f" ({state['catalog_refused']})" if state.get("catalog_refused") else ""
        return "error", (
            f"{app}: replica {replica} does not serve the declared catalog {state.get('catalog_declared')}: "
            f"{state.get('catalog_status')}, catalog_version {state.get('catalog_version')}{since}{why}; it loads "
            "the file once it is readable and valid"
        )
    if version is not None and state.get("catalog_version") != version:
        return "error", (
            f"{app}: replica {replica} serves catalog_version {state.get('catalog_version')}, not the declared file's "
            f"{version}: it has not loaded {state.get('catalog_declared')} as it is now, after {CONVERGED_WITHIN_S:g} s"
        )
    return None


def _since(when: float | None) -> str:
    """`, since <UTC time> (<n> s ago)` for a replica's `catalog_not_declared_since`; "" when it has none."""
    if not isinstance(when, int | float):
        return ""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when))
    return f", since {stamp} ({max(0.0, time.time() - when):.0f} s ago)"


def _reported(url: str, token_env: str | None, running: list[str]) -> dict[str, dict]:
    """The app board's replicas by ID, once every running one has reported (or after a few report periods)."""
    headers = {}
    if token_env is not None:
        token = os.environ.get(token_env)
        if not token:
            raise ValueError(f"the app needs a bearer token: set {token_env} here")
        headers["Authorization"] = f"Bearer {token}"
    deadline = time.monotonic() + REPORTED_WITHIN_S
    while True:
        model = _get_json(f"{url}/v1/model", headers)
        reported = {r["replica"]: r for r in model.get("replicas") or []}
        if set(running) <= set(reported) or time.monotonic() > deadline:
            return reported
        time.sleep(POLL_S)


def app_url(dashboard: str, details: dict, app: str) -> str:
    """The app through Serve's HTTP proxy on the dashboard's host: a proxy bound to every address or to the
    loopback one is reached there (the head runs one)."""
    http = details.get("http_options") or {}
    host = http.get("host") or "127.0.0.1"
    if host in ("0.0.0.0", "::", "127.0.0.1", "localhost"):
        host = urllib.parse.urlsplit(dashboard if "://" in dashboard else f"http://{dashboard}").hostname
    prefix = (details["applications"][app].get("route_prefix") or "/").rstrip("/")
    return f"http://{host}:{http.get('port', 8000)}{prefix}"


def _running_replicas(details: dict, app: str, deployment: str) -> list[str]:
    found = details["applications"][app].get("deployments", {}).get(deployment, {})
    return sorted(r["replica_id"] for r in found.get("replicas", []) if r.get("state") == "RUNNING")


def _user_config(app: dict, deployment: str) -> dict:
    for options in app.get("deployments") or []:
        if isinstance(options, dict) and options.get("name") == deployment:
            return options.get("user_config") or {}
    return {}


def _declared_version(model_dir: str, catalog: str | None) -> str | None:
    """The declared catalog file's version, when it is readable on this machine (None: it is not)."""
    from genrec.catalog.catalog import catalog_version

    try:
        return catalog_version(catalog_file(model_dir, catalog))
    except (OSError, RuntimeError, GenrecError):  # missing here, unreadable, an unknown ~user, renamed after writing
        return None  # the replicas' own reports then say why they refuse it


def _get_json(url: str, headers: dict | None = None) -> dict:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as answer:
        return json.loads(answer.read())
