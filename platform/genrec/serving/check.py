"""Check a Serve config before deploying it: `python -m genrec.serving.check CONFIG.yaml [--model]
[--catalog-arrives]`, and `genrec deploy` (`deploy`), which sends only a config that passes, then reports the rollout
(rollout.py). Serve would find these problems late or never: it drops an unknown key silently, and a `user_config`
change alone runs no builder and reaches the replicas' `reconfigure`, which keeps the running limits if it does not
validate; a catalog file a replica cannot load leaves every replica that starts later refusing requests
(docs/operations.md, 'Deploy checks')."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from genrec.errors import GenrecError
from genrec.model.config import CONFIG_FILE, HSTU_MODEL_TYPE, family_of, read_config, validated_config
from genrec.serving.args import (
    DEPLOYMENTS,
    FAMILY,
    LIVE,
    AppArgs,
    IngressLimits,
    catalog_file,
    family_problem,
    unknown_keys,
)
from genrec.serving.config_yaml import read_yaml
from genrec.serving.rollout import wait_and_report

BUILDER = "genrec.serving.app:build_app"
DEFAULT_DASHBOARD = "http://localhost:8265"  # serve deploy's default address
DASHBOARD_TIMEOUT_S = 10.0
ARRIVES_FLAG = "--catalog-arrives"


@dataclass
class Findings:
    """What a check found: problems (each refuses the config) and warnings (what it could not check here)."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def is_builder(import_path) -> bool:
    """genrec's app builder, in either of the spellings Serve imports (`module:attr` or `module.attr`)."""
    return isinstance(import_path, str) and import_path.replace(":", ".") == BUILDER.replace(":", ".")


def problems(config: dict, check_model: bool = False, catalog_arrives: bool = False) -> list[str]:
    """Every problem of a Serve config (ServeDeploySchema as a dict), each naming where it is."""
    return findings(config, check_model, catalog_arrives).problems


def findings(config: dict, check_model: bool = False, catalog_arrives: bool = False) -> Findings:
    """The config's problems; when it has none, each catalog file its retriever replicas will load (`catalog_files`),
    read as they will read it: without `check_model`, the file alone (no torch), with it, also its codes against
    the model's SID layout. `catalog_arrives`: a declared catalog missing here will be written after the deploy."""
    found = Findings(_config_problems(config, check_model))
    if found.problems:
        return found
    for where, app in _builder_apps(config):
        args = AppArgs.model_validate(app.get("args") or {})
        if args.retriever is not None:
            files = catalog_files(app, where, args.retriever.model_dir, check_model)
            checked = _catalog_findings(where, files, check_model, catalog_arrives)
            found.problems += checked.problems
            found.warnings += checked.warnings
        if args.ranker is not None and not check_model and not _readable_dir(args.ranker.model_dir):
            found.warnings.append(
                f"{where}.args.ranker.model_dir: {args.ranker.model_dir} is not readable here (it may exist only on "
                f"the engine nodes): a partial check, its {CONFIG_FILE} was not checked"
            )
    return found


def _config_problems(config: dict, check_model: bool) -> list[str]:
    from ray.serve.schema import ServeDeploySchema

    if not isinstance(config, dict):
        return [f"(top): a Serve config is a mapping (applications, http_options, ...), not {type(config).__name__}"]
    dropped = unknown_keys(config, ServeDeploySchema)
    found = [f"{where}: not a field of Serve's config (it would be dropped)" for where in dropped]
    if entries := _deployment_entry_problems(config):
        return found + entries  # Serve's schema would fail on them with an AttributeError of its own
    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as err:
        found += [f"{_where(e['loc'])}: {e['msg']}" for e in err.errors()]
    except (ImportError, AttributeError) as err:  # a class it names (a request router, say) that does not import
        found.append(f"applications: names a class that cannot be imported here ({type(err).__name__}: {err})")
    if config.get("applications") == []:
        found.append("applications: empty: serve deploy would delete every app running on the cluster")
    found += _not_builder_problems(config)
    for where, app in _builder_apps(config):
        found += _app_problems(app, where, check_model)
    return found


def _deployment_entry_problems(config: dict) -> list[str]:
    """Each entry of an app's `deployments` that is not a mapping."""
    return [
        f"applications[{i}].deployments[{j}]: a deployment is a mapping (name, num_replicas, ...), not "
        f"{'null' if entry is None else type(entry).__name__}"
        for i, app in enumerate(_list(config.get("applications")))
        if isinstance(app, dict)
        for j, entry in enumerate(_list(app.get("deployments")))
        if not isinstance(entry, dict)
    ]


def _not_builder_problems(config: dict) -> list[str]:
    """An import path into genrec that is not its builder (a typo: every replica would fail to import it)."""
    return [
        f"applications[{i}].import_path: {app['import_path']!r} is not genrec's app builder ({BUILDER})"
        for i, app in enumerate(_list(config.get("applications")))
        if isinstance(app, dict) and isinstance(app.get("import_path"), str)
        and app["import_path"].startswith("genrec.") and not is_builder(app["import_path"])
    ]  # fmt: skip


def _builder_apps(config: dict) -> list[tuple[str, dict]]:
    """The config's genrec apps, each with where it is."""
    apps = _list(config.get("applications"))
    return [
        (f"applications[{i}]", app)
        for i, app in enumerate(apps)
        if isinstance(app, dict) and is_builder(app.get("import_path"))
    ]


def _app_problems(app: dict, where: str, check_model: bool) -> list[str]:
    found = []
    try:
        args = AppArgs.model_validate(app.get("args") or {})
    except ValidationError as err:
        args = None
        found += [f"{where}.args.{_where(e['loc'])}: {e['msg']}" for e in err.errors()]
    live, listed = deployments_of(app.get("args") or {}), {}
    for j, deployment in enumerate(_list(app.get("deployments"))):
        if not isinstance(deployment, dict) or not isinstance(deployment.get("name"), str):
            continue  # Serve's schema has said what it is instead
        name, at = deployment["name"], f"{where}.deployments[{j}]"
        if name not in live:
            found.append(f"{at}.name: no deployment {name!r} in the app (it has {', '.join(live)})")
            continue
        if name in listed:  # Serve applies both, the later's fields over the earlier's, without a word
            found.append(f"{at}.name: {name!r} is listed twice (also {where}.deployments[{listed[name]}]): merge them")
        if "user_config" in deployment:
            found += _user_config_problems(live[name], deployment["user_config"], at, args)
        listed.setdefault(name, j)
    if check_model and args is not None:
        found += _model_problems(args, where)
    elif args is not None:
        found += _family_problems(args, where)
    return found


def _family_problems(args: AppArgs, where: str) -> list[str]:
    """Without `--model`: each engine section's config.json read here (no torch, no weights), the family it names
    against the section's, then its fields. A directory not here is left to the builder's preflight (it may exist
    only on the engine nodes); a path here that is not a directory is refused."""
    found = []
    for name, section in args.engines().items():
        path = Path(section.model_dir)
        if path.exists() and not path.is_dir():
            found.append(f"{where}.args.{name}.model_dir: {path} is not a directory")
        elif _readable_dir(section.model_dir):
            problem = _family_problem(name, path)
            found += [f"{where}.args.{problem}"] if problem else []
    return found


def _family_problem(section: str, path: Path) -> str | None:
    try:
        raw = read_config(path / CONFIG_FILE)
        family = family_of(raw)
        wrong = family_problem(section, path, family)
        if wrong and FAMILY[section] == "hstu":  # a near-miss model_type reads as a Qwen3 decoder's
            model_type = raw.get("model_type") if isinstance(raw, dict) else None
            return f"{wrong} (its config.json's model_type is {model_type!r}; an HSTU ranker's is {HSTU_MODEL_TYPE!r})"
        if wrong:
            return wrong
        validated_config(raw, family, path / CONFIG_FILE)
    except GenrecError as err:
        return f"{section}.model_dir: {err}"
    return None


def _user_config_problems(model: type[BaseModel], user_config, at: str, args: AppArgs | None) -> list[str]:
    """What a deployment's replicas would refuse of its `user_config`: the Ingress's also a deadline longer than its
    drain (`IngressSection.drain_problem`)."""
    try:
        limits = model.model_validate(user_config)
    except ValidationError as err:
        return [f"{at}.user_config.{_where(e['loc'])}: {e['msg']}" for e in err.errors()]
    drained = args is not None and isinstance(limits, IngressLimits) and args.ingress.drain_problem(limits)
    return [f"{at}.user_config.request_timeout_s: {drained}"] if drained else []


# -- the catalogs a retriever's replicas load ---------------------------------------------------------------------


@dataclass(frozen=True)
class CatalogFile:
    """A catalog file a retriever's replicas load, and the config field that makes them load it."""

    field: str
    model_dir: str
    catalog: str | None  # as the user_config names it; None: the model directory's own (genrec/catalog.parquet)

    @property
    def path(self) -> Path:
        """The file (RuntimeError for an unknown ~user, as on the replicas)."""
        return catalog_file(self.model_dir, self.catalog)


def catalog_files(app: dict, where: str, model_dir: str, check_model: bool) -> list[CatalogFile]:
    """What every retriever replica of the app loads: the model directory's own catalog (at start; `--model` has
    loaded it with the directory already) and the one its user_config names, if any."""
    own = [] if check_model else [CatalogFile(f"{where}.args.retriever.model_dir", model_dir, None)]
    declared = []
    for j, deployment in enumerate(_list(app.get("deployments"))):
        if isinstance(deployment, dict) and deployment.get("name") == DEPLOYMENTS["retriever"]:
            config = deployment.get("user_config")
            if isinstance(config, dict) and config.get("catalog") is not None:
                declared.append(
                    CatalogFile(f"{where}.deployments[{j}].user_config.catalog", model_dir, config["catalog"])
                )
    return own + declared


def _catalog_findings(where: str, files: list[CatalogFile], check_model: bool, catalog_arrives: bool) -> Findings:
    """Each of an app's catalog files checked here. Where the model directory is not readable here (it may exist
    only on the engine nodes), a file missing here is left unchecked, said in one warning."""
    found, unchecked = Findings(), []
    model_here = bool(files) and _readable_dir(files[0].model_dir)
    for file in files:
        try:
            path = file.path
        except RuntimeError as err:  # an unknown ~user: the replicas cannot resolve it either
            found.problems.append(f"{file.field}: {file.catalog!r}: {err}")
            continue
        if path.exists():
            problem = _model_catalog_problem(file) if check_model else catalog_file_problem(path)
            found.problems += [f"{file.field}: {problem}"] if problem else []
        elif not model_here:
            unchecked.append(str(path))
        elif not (catalog_arrives and file.catalog is not None):
            found.problems.append(f"{file.field}: {path}: {_missing(file)}")
    if unchecked:
        found.warnings.append(
            f"{where}.args.retriever.model_dir: {files[0].model_dir} is not readable here (it may exist only on the "
            f"engine nodes): a partial check, the catalog its replicas load was not checked ({', '.join(unchecked)})"
        )
    return found


def _missing(file: CatalogFile) -> str:
    if file.catalog is None:
        return "catalog file is missing (every retriever replica loads it at start)"
    return (
        f"catalog file is missing here: a replica that starts would refuse every request until it appears; pass "
        f"{ARRIVES_FLAG} if it will be written there after the deploy"
    )


def _readable_dir(path: str) -> bool:
    return Path(path).is_dir() and os.access(path, os.R_OK | os.X_OK)


def _model_catalog_problem(file: CatalogFile) -> str | None:
    """The file loaded as a replica loads it, its codes checked against the model's SID layout (imports torch)."""
    from genrec.catalog import Catalog
    from genrec.model.directory import ModelDir

    try:
        directory = ModelDir.open(file.model_dir, "qwen3")
        Catalog.load(file.path, directory.load_sid_layout(directory.load_tokenizer()))
    except GenrecError as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 - e.g. an unreadable file: the replicas' refusal too
        return f"{file.path}: {err!r}"
    return None


def catalog_file_problem(path: Path) -> str | None:
    """Why a replica would refuse this catalog file, read as it reads it (`Catalog.load`) before the model's SID layout
    checks its codes: one Parquet file with the catalog's columns and types, and the content hash its name carries.
    None when it passes. Without torch: a deploying machine need not have it."""
    from genrec.catalog.catalog import Catalog

    try:
        Catalog.load(path)
    except GenrecError as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 - e.g. an unreadable file: the replicas' refusal too
        return f"{path}: {err!r}"
    return None


# -- the rest of the config ---------------------------------------------------------------------------------------


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
    document = read_yaml(path.read_text())
    if is_rayservice(document):
        inner = (document.get("spec") or {}).get("serveConfigV2")
        if not isinstance(inner, str):
            raise ValueError("spec.serveConfigV2: a RayService carries its Serve config as a YAML string (`|`)")
        try:
            return read_yaml(inner)
        except yaml.YAMLError as err:  # its lines count from the string's first
            raise ValueError(f"spec.serveConfigV2: {err}") from None
    return document


def is_rayservice(document) -> bool:
    return isinstance(document, dict) and document.get("kind") == "RayService"


def file_problems(path: Path, check_model: bool = False, catalog_arrives: bool = False) -> list[str]:
    """`problems` of a config file, or why it cannot be read."""
    return file_findings(path, check_model, catalog_arrives).problems


def file_findings(path: Path, check_model: bool = False, catalog_arrives: bool = False) -> Findings:
    """`findings` of a config file, or why it cannot be read."""
    try:
        return findings(load(path), check_model, catalog_arrives)
    except (OSError, ValueError, KeyError, TypeError, RecursionError, yaml.YAMLError) as err:
        return Findings([f"cannot read it ({type(err).__name__}: {err})"])


def report(path: Path, found: Findings) -> None:
    """One `warning:` line per warning, then one `error:` line per problem, each naming the config file."""
    for warning in found.warnings:
        print(f"warning: {path}: {warning}", file=sys.stderr)
    for problem in found.problems:
        print(f"error: {path}: {problem}", file=sys.stderr)


def deploy(
    path: Path,
    address: str | None,
    check_model: bool,
    dashboard_timeout_s: float = DASHBOARD_TIMEOUT_S,
    catalog_arrives: bool = False,
) -> int:
    """The exit status: 2 when the config was refused here (nothing sent), else `serve deploy`'s."""
    found = file_findings(path, check_model, catalog_arrives)
    if not found.problems and is_rayservice(read_yaml(path.read_text())):
        found.problems = ["a KubeRay RayService: apply it with kubectl (it is checked, not deployed, here)"]
    report(path, found)
    if found.problems:
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
    return wait_and_report(load(path), dashboard_url(address), is_builder, str(path))


def dashboard_url(address: str | None) -> str:
    """The Ray dashboard `serve deploy` sends a config to (`address`, else RAY_DASHBOARD_ADDRESS, else its default)."""
    address = address or os.environ.get("RAY_DASHBOARD_ADDRESS") or DEFAULT_DASHBOARD
    return address if "://" in address else f"http://{address}"


def dashboard_silence(address: str | None, timeout_s: float = DASHBOARD_TIMEOUT_S) -> str | None:
    """Why the dashboard (`dashboard_url`) does not answer; None when it answers (any HTTP status: that is `serve
    deploy`'s to report)."""
    address = address or os.environ.get("RAY_DASHBOARD_ADDRESS") or DEFAULT_DASHBOARD
    url = dashboard_url(address)
    if not url.startswith(("http://", "https://")):
        return f"--address {address}: serve deploy sends the config to the Ray dashboard, http://<head>:8265"
    try:
        urllib.request.urlopen(f"{url.rstrip('/')}/api/version", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError, http.client.HTTPException) as err:  # URLError, a timeout, a malformed address
        reason = getattr(err, "reason", None) or err
        return (
            f"the Ray dashboard at {address} does not answer ({reason}; waited up to {timeout_s:g} s): start the "
            "cluster (with its dashboard), or pass its address: --address http://<head>:8265"
        )
    return None


def main(argv: list[str]) -> int:
    flags = {"--model", ARRIVES_FLAG}
    paths = [Path(a) for a in argv if a not in flags]
    if not paths:
        print(f"usage: python -m genrec.serving.check CONFIG.yaml... [--model] [{ARRIVES_FLAG}]", file=sys.stderr)
        return 2
    failed = False
    for path in paths:
        found = file_findings(path, "--model" in argv, ARRIVES_FLAG in argv)
        report(path, found)
        failed |= bool(found.problems)
        if not found.problems:
            print(f"ok: {path}")
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
