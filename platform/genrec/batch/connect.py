"""Ray for the batch functions: the cluster a job was submitted to, or a local instance."""

from __future__ import annotations

import os


def ensure_ray(**init_options):
    """Connect to the cluster (`ray job submit` sets RAY_ADDRESS) or start a local one; a connected Ray stays."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local runs; a cluster's own setting wins
    import ray

    if not ray.is_initialized():
        ray.init(**init_options)
    return ray
