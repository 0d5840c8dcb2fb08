"""Check a Serve config before deploying it: `python -m genrec.serving.check CONFIG.yaml [--model]`, and `genrec
deploy` (`deploy`), which sends only a config that passes, then reports the rollout (rollout.py). Serve would find
these problems late or never: it drops an unknown key silently, and a `user_config` change alone runs no builder and
reaches the replicas' `reconfigure`, which keeps the running limits if it does not validate (docs/operations.md,
'Deploy checks')."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from genrec.errors import GenrecError
from genrec.serving.args import DEPLOYMENTS, LIVE, AppArgs, IngressLimits, catalog_file, unknown_keys
from genrec.serving.rollout import wait_and_report

BUILDER = "genrec.serving.app:build_app"
DEFAULT_DASHBOARD = "http://localhost:8265"  # serve deploy's default address
DASHBOARD_TIMEOUT_S = 10.0


def problems(config: dict, check_model: bool = False) -> list[str]:
    """Every problem of a Serve config (ServeDeploySchema as a dict), each naming where it is."""
    from ray.serve.schema import ServeDeploySchema

    if not isinstance(config, dict):
        return [f"(top): a Serve config is a mapping (applications, http_options, ...), not {type(config).__name__}"]
    dropped = unknown_keys(config, ServeDeploySchema)
    found = [f"{where}: not a field of Serve's config (it would be dropped)" for where in dropped]
    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as err:
        found += [f"{_where(e['loc'])}: {e['msg']}" for e in err.errors()]
    for i, app in enumerate(_list(config.get("applications"))):
        if isinstance(app, dict) and app.get("import_path") == BUILDER:
            found += _app_problems(app, f"applications[{i}]", check_model)
    return found


def _app_problems(app: dict, where: str, check_model: bool) -> list[str]:
    found = []
    try:
        args = AppArgs.model_validate(app.get("args") or {})
    except ValidationError as err:
        args = None
        found += [f"{where}.args.{_where(e['loc'])}: {e['msg']}" for e in err.errors()]
    live = deployments_of(app.get("args") or {})
    for j, deployment in enumerate(_list(app.get("deployments"))):
        if not isinstance(deployment, dict):
            continue  # Serve's schema has said what it is instead
        name, at = deployment.get("name"), f"{where}.deployments[{j}]"
        if name not in live:
            found.append(f"{at}.name: no deployment {name!r} in the app (it has {', '.join(live)})")
        elif "user_config" in deployment:
            try:
                live[name].model_validate(deployment["user_config"])
            except ValidationError as err:
                found += [f"{at}.user_config.{_where(e['loc'])}: {e['msg']}" for e in err.errors()]
    if check_model and args is not None:
        found += _model_problems(args, where)
        if not found and args.retriever is not None:
            found += _catalog_problems(app, args.retriever.model_dir, where)
    return found


def _catalog_problems(app: dict, model_dir: str, where: str) -> list[str]:
    """A catalog the retriever's user_config names, loaded as its replicas will load it (they would refuse it and
    keep serving the running one, so a deploy that changes nothing else would silently change nothing)."""
    from genrec.catalog import Catalog  # here: torch loads only to check a model (--model)
    from genrec.model.directory import ModelDir

    found = []
    for j, deployment in enumerate(_list(app.get("deployments"))):
        if not isinstance(deployment, dict) or deployment.get("name") != DEPLOYMENTS["retriever"]:
            continue
        config = deployment.get("user_config")
        if not isinstance(config, dict) or config.get("catalog") is None:
            continue
        directory = ModelDir.open(model_dir, "qwen3")
        try:
            tokenizer = directory.load_tokenizer()
            Catalog.load(catalog_file(model_dir, config["catalog"]), directory.load_sid_layout(tokenizer))
        except GenrecError as err:
            found.append(f"{where}.deployments[{j}].user_config.catalog: {err}")
        except Exception as err:  # noqa: BLE001 - e.g. an unknown ~user, an unreadable file: the replicas' refusal too
            found.append(f"{where}.deployments[{j}].user_config.catalog: {config['catalog']!r}: {err!r}")
    return found


def deployments_of(args: dict) -> dict[str, type[BaseModel]]:
    """The app's deployments (by name) and what their user_config validates into."""
    sections = args if isinstance(args, dict) else {}
    engines = {DEPLOYMENTS[name]: LIVE[name] for name in DEPLOYMENTS if sections.get(name) is not None}
    return {"Ingress": IngressLimits, **engines}


def _model_problems(args: AppArgs, where: str) -> list[str]:
    """The builder's checks (preflight.py), here on this machine."""
    from genrec.serving.preflight import DeployRefused, check_cache, check_family, check_model_dir  # as above

    checked = {}
    try:
        for name, section in args.engines().items():
            try:
                checked[name] = check_model_dir(section.model_dir)
            except GenrecError as err:
                return [f"{where}.args.{name}.model_dir: {err}"]
            check_family(name, checked[name])
        check_cache(args.ingress.cache, checked.get("retriever"))
    except DeployRefused as err:
        return [f"{where}.args.{err}"]  # its message starts with the field it is about
    return []


def _list(value) -> list:
    """A list field as a list ([] for anything else: Serve's schema reports that)."""
    return value if isinstance(value, list) else []


def _where(loc) -> str:
    return ".".join(str(part) for part in loc) or "(top)"


def load(path: Path) -> dict:
    """A Serve config file; a KubeRay RayService file yields the Serve config it carries."""
    document = yaml.safe_load(path.read_text())
    if is_rayservice(document):
        return yaml.safe_load(document["spec"]["serveConfigV2"])
    return document


def is_rayservice(document) -> bool:
    return isinstance(document, dict) and document.get("kind") == "RayService"


def file_problems(path: Path, check_model: bool = False) -> list[str]:
    """`problems` of a config file, or why it cannot be read."""
    try:
        return problems(load(path), check_model)
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError) as err:
        return [f"cannot read it ({type(err).__name__}: {err})"]


def deploy(path: Path, address: str | None, check_model: bool, dashboard_timeout_s: float = DASHBOARD_TIMEOUT_S) -> int:
    """The exit status: 2 when the config was refused here (nothing sent), else `serve deploy`'s."""
    found = file_problems(path, check_model)
    if not found and is_rayservice(yaml.safe_load(path.read_text())):
        found = ["a KubeRay RayService: apply it with kubectl (it is checked, not deployed, here)"]
    for problem in found:
        print(f"error: {path}: {problem}", file=sys.stderr)
    if found:
        print(f"error: {path}: not deployed (the running version, if any, is unchanged)", file=sys.stderr)
        return 2
    silent = dashboard_silence(address, dashboard_timeout_s)
    if silent:
        print(f"error: {path}: not deployed: {silent}", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "ray.serve.scripts", "deploy", str(path)]
    sent = subprocess.run(command + (["--address", address] if address else [])).returncode
    if sent != 0:
        return sent
    return wait_and_report(load(path), dashboard_url(address), BUILDER, str(path))


def dashboard_url(address: str | None) -> str:
    """The Ray dashboard `serve deploy` sends a config to (`address`, else RAY_DASHBOARD_ADDRESS, else its default)."""
    address = address or os.environ.get("RAY_DASHBOARD_ADDRESS") or DEFAULT_DASHBOARD
    return address if "://" in address else f"http://{address}"


def dashboard_silence(address: str | None, timeout_s: float = DASHBOARD_TIMEOUT_S) -> str | None:
    """Why the dashboard (`dashboard_url`) does not answer; None when it answers (any HTTP status: that is `serve
    deploy`'s to report) or the address is not an HTTP one."""
    address = address or os.environ.get("RAY_DASHBOARD_ADDRESS") or DEFAULT_DASHBOARD
    url = dashboard_url(address)
    if not url.startswith(("http://", "https://")):
        return None
    try:
        urllib.request.urlopen(f"{url.rstrip('/')}/api/version", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as err:  # URLError, a timeout, a malformed address
        reason = getattr(err, "reason", None) or err
        return (
            f"the Ray dashboard at {address} does not answer ({reason}; waited up to {timeout_s:g} s): start the "
            "cluster (with its dashboard), or pass its address: --address http://<head>:8265"
        )
    return None


def main(argv: list[str]) -> int:
    check_model = "--model" in argv
    paths = [Path(a) for a in argv if a != "--model"]
    if not paths:
        print("usage: python -m genrec.serving.check CONFIG.yaml... [--model]", file=sys.stderr)
        return 2
    failed = False
    for path in paths:
        found = file_problems(path, check_model)
        for problem in found:
            print(f"error: {path}: {problem}", file=sys.stderr)
        failed |= bool(found)
        if not found:
            print(f"ok: {path}")
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
