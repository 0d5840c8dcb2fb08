"""The builder's preflight (docs/operations.md, "Deploy checks"): before Serve replaces anything, check what the
engine replicas will load (`ModelDir.check`, no weights read), each section's family, and the cache's `dim`
against the retriever's projector. A failure refuses the deploy naming the file; the running version keeps
serving. The check runs where the engines read the directory: in the builder's process when its node could host
an engine, else as a Ray task on a node that can.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ray.serve.exceptions import RayServeException

from genrec.errors import GenrecError
from genrec.model.directory import GENREC_SUBDIR, ModelDir
from genrec.serving.args import AppArgs, EngineSection, family_problem

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 300.0  # a hung volume refuses the deploy instead of stalling it


class DeployRefused(RayServeException):
    """The app cannot be built as configured. A RayServeException: Serve reports its message as the app's
    DEPLOY_FAILED status (once, without the traceback or the three retries of any other builder error)."""


def check_model_dir(path: str | Path) -> ModelDir:
    """`ModelDir.check`: a ModelDirectoryError names the first bad file."""
    directory = ModelDir.open(path)
    directory.check()
    return directory


def check_cache(cache, retriever: ModelDir | None) -> None:
    """The cache's `dim` must be what the retriever's projector takes: else every `user_id` request would get a
    422 blaming the client."""
    if cache is None or retriever is None:
        return
    if retriever.user_dim is None:
        raise DeployRefused(
            f"ingress.cache: {retriever.path} has no soft-token projector ({GENREC_SUBDIR}/soft_token.safetensors) "
            "to take the cache's user vectors; remove cache or use a model with one"
        )
    if cache.dim != retriever.user_dim:
        raise DeployRefused(
            f"ingress.cache.dim is {cache.dim} but the model's soft-token projector ({retriever.path}) takes "
            f"{retriever.user_dim}-d user vectors: use a cache of {retriever.user_dim}-d vectors"
        )


def check_family(section: str, directory: ModelDir) -> None:
    """A retriever holds a Qwen3 model, a ranker an HSTU one."""
    problem = family_problem(section, directory.path, directory.family)
    if problem:
        raise DeployRefused(problem)


def preflight(args: AppArgs) -> dict[str, ModelDir]:
    """The checked directories by section, or DeployRefused; one is left out when no node that could host its
    engine is up (nothing to lose; its replicas check)."""
    checked = {}
    for name, section in args.engines().items():
        directory = _checked(f"{name}.model_dir", section, args.ingress.retry_after_s)
        if directory is not None:
            check_family(name, directory)
            checked[name] = directory
    check_cache(args.ingress.cache, checked.get("retriever"))
    return checked


def _checked(where: str, section: EngineSection, retry_after_s: int) -> ModelDir | None:
    try:
        return _check_where_engines_run(section, retry_after_s)
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


def _check_where_engines_run(section: EngineSection, retry_after_s: int) -> ModelDir | None:
    import ray

    if not ray.is_initialized():  # a plain call outside a cluster: the directory is local
        return check_model_dir(section.model_dir)
    cpus, gpus = section.resources(retry_after_s)
    nodes = engine_nodes(ray.nodes(), cpus, gpus)
    if _this_node() in nodes:
        return check_model_dir(section.model_dir)
    if not nodes:  # e.g. GPU workers scaled to zero: no engine runs, so none can be lost; the replicas check
        log.warning("no node that can host an engine replica is up: %s is checked by the replicas", section.model_dir)
        return None
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    on_node = NodeAffinitySchedulingStrategy(nodes[0], soft=False)
    check = ray.remote(num_cpus=0, max_retries=0, scheduling_strategy=on_node)(check_model_dir)
    try:
        return ray.get(check.remote(section.model_dir), timeout=CHECK_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise DeployRefused(f"model_dir: checking {section.model_dir} took over {CHECK_TIMEOUT_S:g} s") from None
    except ray.exceptions.RayTaskError as err:
        cause = getattr(err, "cause", None)
        raise cause if isinstance(cause, GenrecError) else err from None


def _this_node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()
