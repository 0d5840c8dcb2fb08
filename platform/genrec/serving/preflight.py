"""Before Serve replaces anything: the app builder checks what the engine replicas will load.

A redeploy whose replicas cannot start (a mistyped `model_dir`, a corrupt catalog, a truncated
`model.safetensors`) would otherwise stop healthy replicas for ones that fail. The builder runs these checks
first; a failure refuses the deploy with the file named (Serve marks the app DEPLOY_FAILED) and the running
version keeps serving. Checked without building the model: config.json, the tokenizer (Qwen3), the catalog,
each safetensors file's header against the file's size, the soft-token projector; and that a configured
embedding cache's `dim` is what the projector takes. An app with a ranker (the two-stage funnel) has its
`ranker.model_dir` checked the same way, and each model's family: model_dir a Qwen3 one, the ranker's an HSTU one.

The directory must be checked where the engines read it (a GPU node's volume, not the head's), so the check
runs on a node that can host an engine replica: in the builder's own process when its node can, else as a Ray
task on one that can.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ray.serve.exceptions import RayServeException

from genrec.errors import GenrecError
from genrec.model.directory import GENREC_SUBDIR, ModelDir
from genrec.serving.args import AppArgs, EngineArgs

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 300.0  # a hung volume refuses the deploy instead of stalling it


class DeployRefused(RayServeException):
    """The app cannot be built as configured. A RayServeException: Serve reports its message as the app's
    DEPLOY_FAILED status (once, without the traceback or the three retries of any other builder error)."""


def check_model_dir(path: str | Path) -> ModelDir:
    """Every file an engine replica reads at start, checked (`ModelDir.check`); a ModelDirectoryError names the
    first bad one. The directory object that checked out says its family and user-vector width."""
    directory = ModelDir.open(path)
    directory.check()
    return directory


def check_cache(cache, facts: ModelDir, model_dir: str) -> None:
    """A cache hands its vectors to the soft-token projector: its `dim` must be what the projector takes. A
    mismatch would deploy and answer every `user_id` request with a 422 blaming the client."""
    if cache is None:
        return
    if facts.family == "hstu":
        raise DeployRefused(f"cache: {model_dir} is an HSTU ranking model, which takes no user vectors; remove cache")
    if facts.user_dim is None:
        raise DeployRefused(
            f"cache: {model_dir} has no soft-token projector ({GENREC_SUBDIR}/soft_token.safetensors) to take the "
            "cache's user vectors; remove cache or use a model with one"
        )
    if cache.dim != facts.user_dim:
        raise DeployRefused(
            f"cache.dim is {cache.dim} but the model's soft-token projector ({model_dir}) takes {facts.user_dim}-d "
            f"user vectors: use a cache of {facts.user_dim}-d vectors"
        )


def preflight(args: AppArgs) -> ModelDir | None:
    """The builder's checks: the model directory where an engine would read it, then the cache against the
    model; with a ranker, its directory too and each model's family (a Qwen3 retriever, an HSTU ranker). Raises
    DeployRefused. None: no node that could host an engine is up, so nothing was checked."""
    facts = _checked("model_dir", args)
    if facts is not None:
        check_cache(args.cache, facts, args.model_dir)
    if args.ranker is not None:
        check_funnel(facts, _checked("ranker.model_dir", args.ranker), args)
    return facts


def check_funnel(retriever: ModelDir | None, ranker: ModelDir | None, args: AppArgs) -> None:
    """A funnel retrieves with a Qwen3 model and ranks with an HSTU one (None: that one was not checked)."""
    if retriever is not None and retriever.family != "qwen3":
        raise DeployRefused(
            f"model_dir: {args.model_dir} is an HSTU ranking model; with a ranker, model_dir must be a Qwen3 "
            "retrieval model (or remove ranker)"
        )
    if ranker is not None and ranker.family != "hstu":
        raise DeployRefused(f"ranker.model_dir: {args.ranker.model_dir} is a Qwen3 model, not an HSTU ranking model")


def _checked(where: str, engine: EngineArgs) -> ModelDir | None:
    try:
        return _check_where_engines_run(engine)
    except GenrecError as err:
        raise DeployRefused(f"{where}: {err}") from None


def engine_nodes(nodes: list[dict], cpus: float, gpus: float) -> list[str]:
    """IDs of the alive nodes whose resources could host one engine replica (`ray.nodes()` entries)."""
    return [
        node["NodeID"]
        for node in nodes
        if node.get("Alive")
        and node.get("Resources", {}).get("CPU", 0) >= cpus
        and node.get("Resources", {}).get("GPU", 0) >= gpus
    ]


def _check_where_engines_run(args: EngineArgs) -> ModelDir | None:
    import ray

    if not ray.is_initialized():  # a plain call outside a cluster: the directory is local
        return check_model_dir(args.model_dir)
    cpus, gpus = args.engine_resources()
    nodes = engine_nodes(ray.nodes(), cpus, gpus)
    if _this_node() in nodes:
        return check_model_dir(args.model_dir)
    if not nodes:  # e.g. GPU workers scaled to zero: no engine runs, so none can be lost; the replicas check
        log.warning("no node that can host an engine replica is up: %s is checked by the replicas", args.model_dir)
        return None
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    on_node = NodeAffinitySchedulingStrategy(nodes[0], soft=False)
    check = ray.remote(num_cpus=0, max_retries=0, scheduling_strategy=on_node)(check_model_dir)
    try:
        return ray.get(check.remote(args.model_dir), timeout=CHECK_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise DeployRefused(f"model_dir: checking {args.model_dir} took over {CHECK_TIMEOUT_S:g} s") from None
    except ray.exceptions.RayTaskError as err:
        cause = getattr(err, "cause", None)
        raise cause if isinstance(cause, GenrecError) else err from None


def _this_node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()
