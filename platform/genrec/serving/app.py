"""The application builder named by every Serve config: `import_path: genrec.serving.app:build_app`."""

# No `from __future__ import annotations`: Serve reads build_app's parameter annotation (AppArgs) to
# validate a config's `args`; a string annotation would hand it a plain dict.
from ray.serve import Application

from genrec.serving.args import DEPLOYMENTS, AppArgs, EngineSection
from genrec.serving.engine_server import EngineServer
from genrec.serving.ingress import Ingress
from genrec.serving.preflight import preflight
from genrec.serving.router import USER_ROUTER
from genrec.serving.schemas import RankerFacts


def build_app(args: AppArgs) -> Application:
    """The app of `args`, refused (preflight.py) before Serve replaces any replica if its engines could not start."""
    checked = preflight(args)
    ranker = checked.get("ranker")
    facts = RankerFacts.of(ranker.config, args.ranker.max_candidates) if ranker is not None else None
    return application(args, facts)


def application(args: AppArgs, ranker_facts: RankerFacts | None = None) -> Application:
    """Ingress -> each section's engine deployment. `ranker_facts`: what the ingress checks a two-stage request
    against (None: it asks the ranker)."""
    engines = {name: _engine(args, section, DEPLOYMENTS[name]) for name, section in args.engines().items()}
    ingress = args.ingress
    options = ingress.deployment_options(ingress.defaults()) | {"user_config": ingress.limits.model_dump()}
    idle_at_zero = frozenset(name for name, section in args.engines().items() if section.scales_to_zero())
    handles = engines.get("retriever"), engines.get("ranker")
    return Ingress.options(**options).bind(*handles, ingress, ranker_facts, idle_at_zero)


def _engine(args: AppArgs, section: EngineSection, name: str):
    return EngineServer.options(name=name, **engine_deployment(args, section)).bind(
        section.model_dir, section.device, section.replica_options(), section.limits
    )


def engine_deployment(args: AppArgs, section: EngineSection) -> dict:
    """An engine deployment's Serve options: the section's over genrec's defaults, limits, request router."""
    options = section.deployment_options(section.defaults(args.ingress.retry_after_s))
    options["user_config"] = section.limits.model_dump()
    if section.router == "user":
        options["request_router_config"] = {"request_router_class": USER_ROUTER}
    return options
