"""The flat `args` of earlier releases, read for one more release: converted to the sections (args.py), with a
warning that shows the same app in the new form. The flat form's main engine becomes the `retriever` (an HSTU
model there is refused by the preflight with the form to use: under `ranker`).
"""

from __future__ import annotations

import json

# The flat form's engine keys that stay the section's own, and those that became Serve deployment options.
ENGINE_KEYS = {
    "model_dir", "device", "limits", "dtype", "max_candidates", "score_max_tokens", "max_candidate_tokens",
    "cuda_fast", "kv_budget_bytes", "prefix_cache_bytes", "host_cache_bytes", "torch_threads", "pin_threads",
}  # fmt: skip
ENGINE_DEPLOYMENT = {
    "engine_num_cpus": ("ray_actor_options", "num_cpus"),
    "engine_num_gpus": ("ray_actor_options", "num_gpus"),
    "min_replicas": ("autoscaling_config", "min_replicas"),
    "max_replicas": ("autoscaling_config", "max_replicas"),
    "target_ongoing_requests": ("autoscaling_config", "target_ongoing_requests"),
    "downscale_delay_s": ("autoscaling_config", "downscale_delay_s"),
    "max_ongoing_requests": ("max_ongoing_requests",),
    "max_queued_requests": ("max_queued_requests",),
}
INGRESS_KEYS = {"auth_token_env", "cache", "retry_after_s", "body_timeout_s", "routing_prefix_blocks"}
INGRESS_DEPLOYMENT = {
    "ingress_num_cpus": ("ray_actor_options", "num_cpus"),
    "ingress_replicas": ("num_replicas",),
    "ingress_max_ongoing_requests": ("max_ongoing_requests",),
    "ingress_max_queued_requests": ("max_queued_requests",),
}
FLAT = ENGINE_KEYS | set(ENGINE_DEPLOYMENT) | {"engine_router"} | INGRESS_KEYS | set(INGRESS_DEPLOYMENT)
FLAT |= {"request_timeout_s"}


def is_flat(raw) -> bool:
    return isinstance(raw, dict) and bool(FLAT & set(raw))


def sectioned(raw):
    """`raw` args in the sectioned form: the flat form converted, anything else as it is. A key of neither form
    stays where it was, so that validation refuses it by name."""
    if not is_flat(raw):
        return raw
    mixed = sorted({"retriever", "ingress"} & set(raw))
    if mixed:
        raise ValueError(f"the flat form (model_dir, ... at the top) and {mixed[0]!r} cannot be mixed: use sections")
    ingress = _section(raw, INGRESS_KEYS, INGRESS_DEPLOYMENT)
    if "request_timeout_s" in raw:
        ingress["limits"] = {"request_timeout_s": raw["request_timeout_s"]}
    new = {key: value for key, value in raw.items() if key not in FLAT | {"ranker"}}
    new |= {"retriever": _engine(raw), "ingress": ingress}
    ranker = raw.get("ranker")
    if ranker is not None:
        unknown = {key: value for key, value in ranker.items() if key not in FLAT} if is_flat(ranker) else {}
        new["ranker"] = _engine(ranker) | unknown if is_flat(ranker) else ranker
    return new


def deprecation(raw) -> str | None:
    """What to tell the operator of args in the flat form (None: they are not)."""
    if not is_flat(raw):
        return None
    new = json.dumps(sectioned(raw), sort_keys=True)
    return f"args in the flat form are deprecated (refused in the next release); the same app in sections: {new}"


def _engine(raw: dict) -> dict:
    section = _section(raw, ENGINE_KEYS, ENGINE_DEPLOYMENT)
    if "engine_router" in raw:
        section["router"] = raw["engine_router"]
    return section


def _section(raw: dict, own: set[str], deployment: dict[str, tuple[str, ...]]) -> dict:
    """The keys of `raw` that are the section's own, and its Serve options from their flat names."""
    section = {key: raw[key] for key in own if key in raw}
    options: dict = {}
    for flat, path in deployment.items():
        if flat in raw:
            target = options
            for key in path[:-1]:
                target = target.setdefault(key, {})
            target[path[-1]] = raw[flat]
    if options:
        section["deployment"] = options
    return section
