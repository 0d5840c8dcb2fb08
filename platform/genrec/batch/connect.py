"""Ray for the batch functions: the cluster a job was submitted to, or a local instance; and whether it can ever
start the job's actors."""

from __future__ import annotations

import importlib
import os
import time

from genrec.errors import GenrecError


def ensure_ray(**init_options):
    """Connect to the cluster (`ray job submit` sets RAY_ADDRESS) or start a local one; a connected Ray stays."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local runs; a cluster's own setting wins
    import ray

    if not ray.is_initialized():
        ray.init(**init_options)
    return ray


def check_gpus(ray, per_actor: float, wait_s: float = 0.0, poll_s: float = 2.0) -> None:
    """Refuse GPUs per actor that no node has and the autoscaler does not offer: Ray would wait forever. Its
    published node types count (Ray Train and Ray Data read the same); for an autoscaler that publishes none
    (`ray up`'s), `wait_s` > 0 asks it for a node (`request_resources`) and waits that long for it."""
    if per_actor <= 0 or _largest_gpu_node(ray) >= per_actor or _offered_gpus(ray) >= per_actor:
        return
    if wait_s > 0 and _wait_for_gpu_node(ray, per_actor, wait_s, poll_s):
        return
    gpus = ray.cluster_resources().get("GPU", 0)
    waited = f", and none joined within {wait_s:g} s (gpu_wait_s)" if wait_s > 0 else ""
    raise GenrecError(
        f"num_gpus={per_actor:g} per actor: no node of the cluster has that many GPUs (it has {gpus:g} in all) and "
        f"its autoscaler offers none{waited}; use --num-gpus 0 (the CPU engine), a cluster with GPUs, or "
        "--gpu-wait-s S where GPU nodes start on demand"
    )


def _largest_gpu_node(ray) -> float:
    return max((n["Resources"].get("GPU", 0) for n in ray.nodes() if n["Alive"]), default=0)


def _offered_gpus(ray) -> float:
    """The GPUs of the autoscaler's largest GPU node type, 0 when it publishes none (or no autoscaler runs)."""
    try:  # a private API of Ray's (its own libraries call it): any failure means "not known"
        config = ray._private.state.state.get_cluster_config()
        groups = config.node_group_configs if config is not None else []
        return max((g.resources.get("GPU", 0) for g in groups if g.max_count != 0), default=0)
    except Exception:
        return 0


def _wait_for_gpu_node(ray, per_actor: float, wait_s: float, poll_s: float) -> bool:
    importlib.import_module("ray.autoscaler.sdk")  # makes ray.autoscaler.sdk reachable
    ray.autoscaler.sdk.request_resources(bundles=[{"GPU": per_actor}])
    try:
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(poll_s, left))
            if _largest_gpu_node(ray) >= per_actor:
                return True
        return False
    finally:
        ray.autoscaler.sdk.request_resources(bundles=[])  # the request ends; the actors' own demand holds the node
