"""The application builder named by every Serve config: `import_path: genrec.serving.app:build_app`."""

# No `from __future__ import annotations`: Serve reads build_app's parameter annotation (AppArgs) to
# validate a config's `args`; a string annotation would hand it a plain dict.
from ray.serve import Application

from genrec.serving.args import AppArgs, EngineArgs
from genrec.serving.engine_server import EngineServer
from genrec.serving.ingress import Ingress
from genrec.serving.preflight import preflight
from genrec.serving.router import USER_ROUTER


def build_app(args: AppArgs) -> Application:
    """The app of `args`, once what its engine replicas will load has checked out (preflight.py): a deploy that
    could not start them is refused here, before Serve replaces any running replica."""
    preflight(args)
    return application(args)


ENGINE = "EngineServer"
RANKER = "RankerServer"  # the funnel's second engine deployment: the same class, an HSTU model


def application(args: AppArgs) -> Application:
    """Ingress -> EngineServer (and, with a ranker, -> RankerServer), each deployment's options derived from the
    arguments (nothing checked)."""
    engine = _engine(args, args, ENGINE)
    ranker = _engine(args, args.ranker, RANKER) if args.ranker is not None else None
    ingress = Ingress.options(
        num_replicas=args.ingress_replicas,
        max_ongoing_requests=args.ingress_max_ongoing_requests,
        max_queued_requests=args.ingress_max_queued_requests,
        backpressure_config=backpressure(args),
        ray_actor_options={"num_cpus": args.ingress_num_cpus},
        user_config=args.ingress_limits().model_dump(),
    )
    return ingress.bind(engine, args.ingress_settings(), args.ingress_limits(), ranker)


def _engine(args: AppArgs, engine: EngineArgs, name: str):
    return EngineServer.options(name=name, **engine_deployment(args, engine)).bind(
        engine.model_dir, engine.device, engine.replica_options(), engine.limits
    )


def engine_deployment(args: AppArgs, engine: EngineArgs | None = None) -> dict:
    """An engine deployment's Serve options: the main engine's (`engine` None) or the ranker's."""
    engine = engine or args
    cpus, gpus = engine.engine_resources()
    return {
        "ray_actor_options": {"num_cpus": cpus, "num_gpus": gpus},
        # High enough that concurrent requests meet inside the engine's batching loop; the engine's own
        # max_queue, then the handle's max_queued_requests, bound what waits.
        "max_ongoing_requests": engine.max_ongoing_requests,
        "max_queued_requests": engine.max_queued_requests,
        "backpressure_config": backpressure(args),
        "autoscaling_config": {
            "min_replicas": engine.min_replicas,
            "max_replicas": engine.max_replicas,
            "target_ongoing_requests": engine.target_ongoing_requests,
            "downscale_delay_s": engine.downscale_delay_s,
        },
        "user_config": engine.limits.model_dump(),
        **router(engine),
    }


def router(engine: EngineArgs) -> dict:
    """An engine deployment's request router (a config file's `request_router_config` overrides it)."""
    if engine.engine_router == "serve_default":
        return {}
    return {"request_router_config": {"request_router_class": USER_ROUTER}}


def backpressure(args: AppArgs) -> dict:
    """Past max_queued_requests: 503 with Retry-After, so clients back off instead of piling up."""
    return {"status_code": 503, "retry_after_s": args.retry_after_s}
