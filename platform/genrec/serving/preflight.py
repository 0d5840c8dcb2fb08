"""Before Serve replaces anything: the app builder checks what the engine replicas will load.

A redeploy whose replicas cannot start (a mistyped `model_dir`, a corrupt catalog, a truncated
`model.safetensors`, a config.json edited apart from its weights) would otherwise stop healthy replicas for ones
that fail. The builder runs these checks first; a failure refuses the deploy with the file named (Serve marks the
app DEPLOY_FAILED) and the running version keeps serving. Each engine section's directory is checked without
reading the weights (`ModelDir.check`: config.json, the tokenizer, the catalog, each safetensors file's header
against the file's size and each tensor's shape and dtype in it against what config.json implies, the soft-token
projector), and its family: the retriever's a Qwen3 model, the ranker's an HSTU one; then that a configured
embedding cache's `dim` is what the retriever's projector takes.

The directory must be checked where the engines read it (a GPU node's volume, not the head's), so the check
runs on a node that can host an engine replica: in the builder's own process when its node can, else as a Ray
task on one that can.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ray.serve.exceptions import RayServeException

from genrec.errors import GenrecError
from genrec.model.directory import FAMILY_NAMES, GENREC_SUBDIR, ModelDir
from genrec.serving.args import FAMILY, AppArgs, EngineSection

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


def check_cache(cache, retriever: ModelDir | None) -> None:
    """A cache hands its vectors to the retriever's soft-token projector: its `dim` must be what the projector
    takes. A mismatch would deploy and answer every `user_id` request with a 422 blaming the client."""
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
    family = FAMILY[section]
    other = next(name for name, f in FAMILY.items() if f == directory.family)
    if directory.family != family:
        raise DeployRefused(
            f"{section}.model_dir: {directory.path} is {FAMILY_NAMES[directory.family]}, not "
            f"{FAMILY_NAMES[family]}: put it under `{other}`"
        )


def preflight(args: AppArgs) -> dict[str, ModelDir]:
    """The builder's checks: each engine section's model directory where its engine would read it, its family,
    then the cache against the retriever's model. Raises DeployRefused. The directories that were checked, by
    section: one is left out when no node that could host its engine is up (nothing to lose; its replicas check)."""
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
