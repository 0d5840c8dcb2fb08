"""The application's arguments: what a Serve config's `args` may say, validated at deploy time.

Three sections of one shape (`retriever`, `ranker`, `ingress`; docs/serving.md, "The app's args"). Each says what
its deployment is built with (a change replaces its replicas), what may change live (`limits`, sent as the
deployment's `user_config`) and Serve's own options (`deployment`, passed through over genrec's defaults).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from genrec.api import Float, Int
from genrec.cache.config import CacheConfig
from genrec.engine_options import ON_HSTU, EngineOptions
from genrec.model.config import FAMILY_NAMES
from genrec.threads import ThreadSettings

if TYPE_CHECKING:
    from genrec.engine import SchedulerConfig

log = logging.getLogger(__name__)

# The model family each engine section holds, and its deployment's name (what a config's `deployments` overrides).
FAMILY = {"retriever": "qwen3", "ranker": "hstu"}
DEPLOYMENTS = {"retriever": "EngineServer", "ranker": "RankerServer"}
# Keys of a section's `deployment` that genrec sets from the section itself.
OWNED = {
    "name": "the deployment's name is genrec's (Ingress, EngineServer, RankerServer)",
    "user_config": "it is the section's `limits`",
    "request_router_config": "choose it with the section's `router` (or override it in the config's `deployments`)",
}
FREE_FORM = {"args", "user_config", "runtime_env", "env_vars", "resources"}  # dicts Serve passes through


def family_problem(section: str, model_dir, family: str) -> str | None:
    """Why `section` cannot hold the model in `model_dir`, of `family`: a retriever holds a Qwen3 model, a ranker an
    HSTU one. None when it can."""
    if family == FAMILY[section]:
        return None
    other = next(name for name, f in FAMILY.items() if f == family)
    return (
        f"{section}.model_dir: {model_dir} is {FAMILY_NAMES[family]}, not {FAMILY_NAMES[FAMILY[section]]}: put it "
        f"under `{other}`"
    )


def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation may hold (through Optional, Union, list, dict values)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found = []
    for arg in get_args(annotation):
        found += _models_in(arg)
    return found


def unknown_keys(value, model: type[BaseModel], path: str = "") -> list[str]:
    """Where `value` (a config's dict) has keys `model` (a Serve schema) does not define."""
    if isinstance(value, list):
        return [bad for i, item in enumerate(value) for bad in unknown_keys(item, model, f"{path}[{i}]")]
    if not isinstance(value, dict):
        return []
    fields = {f.alias or name: f for name, f in model.model_fields.items()} | dict(model.model_fields)
    bad = []
    for key, item in value.items():
        where = f"{path}.{key}" if path else key
        if key not in fields:
            bad.append(where)
        elif key not in FREE_FORM:
            for sub in _models_in(fields[key].annotation):
                bad += unknown_keys(item, sub, where)
    return bad


def deployment_problems(options: dict) -> list[str]:
    """What Serve would drop or refuse in one deployment's options (unknown keys, bad values), each located."""
    # Ray Serve's schemas on first use: importing these arguments stays light.
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import DeploymentSchema

    found = [f"{where}: not an option of a Serve deployment" for where in unknown_keys(options, DeploymentSchema)]
    scaling = options.get("autoscaling_config")
    if isinstance(scaling, dict) and isinstance(scaling.get("policy"), dict):
        policy = _policy_problems(scaling["policy"])
        if policy:  # Serve's schemas would raise the import error itself, not a validation error
            return found + policy
    checks = [(DeploymentSchema, {"name": "check", **options})]
    if isinstance(scaling, dict):
        checks.append((AutoscalingConfig, scaling))
    for model, value in checks:
        try:
            model.model_validate(value)
        except ValidationError as err:
            prefix = "autoscaling_config." if model is AutoscalingConfig else ""
            found += [f"{prefix}{'.'.join(map(str, e['loc'])) or '(options)'}: {e['msg']}" for e in err.errors()]
    return found


def _policy_problems(policy: dict) -> list[str]:
    """An autoscaling policy Serve's controller could not load or build: its import path must import here, and a
    policy class must take its `policy_kwargs` (Serve builds it with them in its controller, after the deploy was
    sent)."""
    import inspect

    from ray.serve.config import AutoscalingPolicy

    where = "autoscaling_config.policy"
    try:
        loaded = AutoscalingPolicy.model_validate(policy)
    except ValidationError as err:
        return [f"{where}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
    except (ImportError, AttributeError, ValueError) as err:
        return [f"{where}.policy_function: cannot import {policy.get('policy_function')!r} ({err})"]
    function = loaded.get_policy()
    if inspect.isclass(function):
        try:
            function(**loaded.policy_kwargs)
        except (TypeError, ValueError) as err:
            return [f"{where}.policy_kwargs: {function.__name__} refuses {loaded.policy_kwargs} ({err})"]
    return []


# A rolling restart (any change to `args`) starts each replacement before it stops the replica it replaces, up to
# this share of a deployment's replicas at once (at least one): a deployment of one replica has no gap. Serve's own
# default (0) stops first. Where the cluster has no room for the extra replica the old ones keep serving and the
# replacement waits for room; `max_surge_percent: 0` in a section's `deployment` stops first instead.
ROLLOUT_SURGE_PERCENT = 25


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a typo in a config file fails the deploy instead of vanishing


class _Deployed(_Args):
    deployment: dict[str, Any] = Field(
        {},
        description="Serve's deployment options for this deployment (num_replicas or autoscaling_config, "
        "max_ongoing_requests, max_queued_requests, ray_actor_options, health checks...), over genrec's defaults",
    )

    @field_validator("deployment")
    @classmethod
    def _serve_options(cls, options: dict) -> dict:
        """Checked as Serve will check them, and for what Serve would drop silently (an unknown key)."""
        for key in options:
            if key in OWNED:
                raise ValueError(f"{key!r} is not set here: {OWNED[key]}")
        drain = options.get("graceful_shutdown_timeout_s", 0)  # genrec compares it with the deadline itself
        if isinstance(drain, bool) or not isinstance(drain, int | float):
            raise ValueError(f"graceful_shutdown_timeout_s: a number of seconds, not {drain!r}")
        problems = deployment_problems(options)
        if problems:
            raise ValueError("; ".join(problems))
        return options

    def deployment_options(self, defaults: dict) -> dict:
        """The section's `deployment` over genrec's defaults; its own `num_replicas` replaces the autoscaling."""
        merged = _merged({"max_surge_percent": ROLLOUT_SURGE_PERCENT, **defaults}, self.deployment)
        if "num_replicas" in self.deployment and "autoscaling_config" not in self.deployment:
            merged.pop("autoscaling_config", None)
        return merged


class EngineLimits(_Args):
    """What may change live (`user_config` -> `reconfigure`); a field left out reverts to its default."""

    max_queue: Int = Field(256, ge=1, description="requests waiting in one replica's engine; beyond: 503")
    max_running: Int | None = Field(None, ge=1, description="requests batched at once (default: by device)")
    prefill_tokens_per_step: Int = Field(4096, ge=1)


CATALOG_HELP = (
    "the catalog file the retriever serves, absolute or relative to its model_dir (default: the model directory's "
    "genrec/catalog.parquet). A change is loaded by every running replica without a restart: built beside the "
    "serving loop and swapped between requests; the version it replaces is kept, so setting it back is a "
    "rollback. One that does not validate is refused and the running catalog stays"
)


class RetrieverLive(EngineLimits):
    """The retriever's `user_config`: its live limits and the catalog it serves."""

    catalog: str | None = Field(None, min_length=1, description=CATALOG_HELP)

    def limits(self) -> EngineLimits:
        return EngineLimits.model_validate(self.model_dump(exclude={"catalog"}))


# What each engine section's user_config validates into (its `reconfigure`; the config check's).
LIVE = {"retriever": RetrieverLive, "ranker": EngineLimits}


def catalog_file(model_dir: str, catalog: str | None) -> Path:
    """The catalog a retriever's user_config names (relative to model_dir), or the model's own."""
    if catalog is None:
        return Path(model_dir) / "genrec" / "catalog.parquet"
    return Path(model_dir) / Path(catalog).expanduser()  # an absolute `catalog` replaces model_dir


class ReplicaOptions(EngineOptions, ThreadSettings):
    """What an engine replica is built with (engine options, pool sizes, threads); a change replaces replicas."""

    kv_budget_bytes: Int | None = Field(
        None,
        ge=1,
        description="the KV pool, allocated once (default: 4 GiB on the CPU, half the free GPU memory)",
    )
    prefix_cache_bytes: Int | None = Field(
        None,
        ge=0,
        description="prompts' K/V kept for reuse by later prompts with the same start (default: half "
        "the KV pool; 0: off)",
    )
    host_cache_bytes: Int = Field(
        0,
        ge=0,
        description="host memory evicted prefixes spill to (CUDA; verified, opt-in: 0, off, by default)",
    )

    def scheduler_config(self, limits: EngineLimits = EngineLimits()) -> SchedulerConfig:
        from genrec.engine import SchedulerConfig  # here: the ingress imports these arguments without torch

        sizes = self.model_dump(include={"kv_budget_bytes", "prefix_cache_bytes", "host_cache_bytes"})
        return SchedulerConfig(**limits.model_dump(), **sizes)


class EngineSection(ReplicaOptions, _Deployed):
    """One engine deployment (retriever: EngineServer; ranker: RankerServer)."""

    model_dir: str = Field(description="a genrec model directory, present on every node that runs an engine")
    device: Literal["cpu", "cuda"] = "cpu"
    limits: EngineLimits = EngineLimits()
    router: Literal["user", "serve_default"] = Field(
        "user",
        description="user: each user's requests to the engine replica holding their K/V (genrec.serving.router); "
        "serve_default: Serve's power-of-two-choices router",
    )

    @field_validator("model_dir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        """Relative to where the app is built (`serve run`'s directory), so every replica finds it."""
        try:
            return str(Path(value).expanduser().resolve())
        except RuntimeError as err:  # a symlink loop; `~user` of no such user
            raise ValueError(f"{value!r} cannot be resolved here ({err})") from None

    @model_validator(mode="after")
    def _a_gpu_for_cuda(self):
        if self.device == "cuda" and not self.resources()[1] > 0:
            raise ValueError("device cuda needs a GPU in each replica: deployment.ray_actor_options.num_gpus > 0")
        return self

    def replica_options(self) -> ReplicaOptions:
        return ReplicaOptions.model_validate(self.model_dump(include=set(ReplicaOptions.model_fields)))

    def defaults(self, retry_after_s: int) -> dict:
        """genrec's defaults. max_ongoing_requests is high so concurrent requests meet in the engine's batching
        loop; max_queue, then max_queued_requests, bound what waits (past them 503)."""
        return {
            "ray_actor_options": {"num_cpus": 1, "num_gpus": 1 if self.device == "cuda" else 0},
            "max_ongoing_requests": 256,
            "max_queued_requests": 512,
            "autoscaling_config": {
                "min_replicas": 1,
                "max_replicas": 1,
                "target_ongoing_requests": 32,
                "downscale_delay_s": 600,  # low traffic this long before a replica (and its prefix cache) goes
            },
            "backpressure_config": {"status_code": 503, "retry_after_s": retry_after_s},
        }

    def scales_to_zero(self) -> bool:
        """Whether min_replicas is 0: a request must then reach Serve's handle, which starts a replica, so none is
        answered for want of a running one."""
        options = self.deployment_options(self.defaults(1))
        return "num_replicas" not in options and options.get("autoscaling_config", {}).get("min_replicas", 1) == 0

    def resources(self, retry_after_s: int = 1) -> tuple[float, float]:
        """CPUs and GPUs one replica reserves (a config file's `deployments` may still override them)."""
        actor = self.deployment_options(self.defaults(retry_after_s))["ray_actor_options"]
        return actor.get("num_cpus", 1), actor.get("num_gpus", 0)


# How much longer than a request's deadline Serve lets a replaced ingress replica finish before killing it (the
# client would get the proxy's plain-text 500): every request ends by its deadline; Serve's drain loop looks every 2 s.
DRAIN_MARGIN_S = 5.0


class IngressLimits(_Args):
    """What may change live in the ingress (`user_config` -> `reconfigure`)."""

    request_timeout_s: Float = Field(30.0, gt=0, description="deadline of a request (504 past it)")


class IngressSection(_Deployed):
    """The HTTP front (Ingress); a change replaces its replicas, but for its live `limits`."""

    auth_token_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",  # a name no variable can have: every replica would fail to start
        description="name of the environment variable holding the bearer token; unset: no auth",
    )
    cache: CacheConfig | None = Field(None, description="resolve user_id -> user_embedding through this cache")
    retry_after_s: Int = Field(1, ge=1, description="Retry-After of every 503 when the app is overloaded")
    body_timeout_s: Float = Field(
        10.0,
        gt=0,
        description="a request's whole body must arrive within this; 408 past it (frees the slot)",
    )
    routing_prefix_blocks: Int = Field(
        1,
        ge=1,
        le=64,
        description="first blocks of a prompt (16 tokens or history events, 64 text characters) whose digest "
        "routes a request without user_id: more than a template every prompt opens with",
    )
    funnel_reserve_s: Float = Field(
        1.0,
        ge=0,
        description="a two-stage recommend: the part of the deadline the retrieval leaves to the ranking (at most "
        "half the deadline)",
    )
    funnel_on_ranker_failure: Literal["degrade", "fail"] = Field(
        "degrade",
        description="a two-stage recommend whose ranking fails (the ranker unavailable, overloaded or out of time): "
        "degrade, the retrieval in beam order marked `degraded`; fail, a 503 or 504",
    )
    limits: IngressLimits = IngressLimits()

    def defaults(self) -> dict:
        return {
            "num_replicas": 1,
            "ray_actor_options": {"num_cpus": 0.25},
            "max_ongoing_requests": 1024,  # a slow body holds one for body_timeout_s at most
            "max_queued_requests": 2048,
            "backpressure_config": {"status_code": 503, "retry_after_s": self.retry_after_s},
            "graceful_shutdown_timeout_s": self.limits.request_timeout_s + DRAIN_MARGIN_S,
        }

    def drain_s(self) -> float:
        """The deployment's graceful_shutdown_timeout_s."""
        return self.deployment.get("graceful_shutdown_timeout_s", self.defaults()["graceful_shutdown_timeout_s"])

    def drain_problem(self, limits: IngressLimits) -> str | None:
        """Why this deadline would let a replaced replica be killed with requests in flight (None: it cannot)."""
        if limits.request_timeout_s + DRAIN_MARGIN_S > self.drain_s():
            return (
                f"request_timeout_s {limits.request_timeout_s:g} needs the ingress's graceful_shutdown_timeout_s of "
                f"at least {limits.request_timeout_s + DRAIN_MARGIN_S:g} (it is {self.drain_s():g}): a replaced "
                "replica would be killed with requests in flight"
            )
        return None

    def live(self, user_config, running: IngressLimits) -> tuple[IngressLimits, str | None]:
        """`live_limits`, also refusing a deadline longer than a replaced replica is given to finish."""
        limits, refused = live_limits(IngressLimits, user_config, running)
        if refused is None and (refused := self.drain_problem(limits)) is not None:
            log.error("user_config %r refused, the running limits stay (%s): %s", user_config, running, refused)
            return running, refused
        return limits, refused

    @model_validator(mode="after")
    def _cache_dim(self):
        if self.cache is not None and self.cache.dim is None:
            raise ValueError("cache.dim is required: the user vectors' width (the model's soft-token input size)")
        return self

    @model_validator(mode="after")
    def _drains_within_the_deadline(self):
        problem = self.drain_problem(self.limits)
        if problem is not None:
            raise ValueError(f"deployment.graceful_shutdown_timeout_s: {problem}")
        return self


class AppArgs(_Args):
    """A retriever, a ranker, or both (the funnel), behind one ingress."""

    retriever: EngineSection | None = Field(
        None, description="a Qwen3 semantic-ID model: /v1/retrieve, /v1/score, /v1/recommend"
    )
    ranker: EngineSection | None = Field(
        None,
        description="an HSTU ranking model, scaled on its own: /v1/rank, and with a retriever, /v1/recommend with a "
        "`history` ranks the retrieved items with it",
    )
    ingress: IngressSection = IngressSection()

    @field_validator("ranker")
    @classmethod
    def _no_decoder_option(cls, section: EngineSection | None) -> EngineSection | None:
        name = section and section.decoder_option_set()
        if name:
            raise ValueError(f"{name} {ON_HSTU.format(model='a ranker')}")
        return section

    @model_validator(mode="after")
    def _a_model(self):
        if self.retriever is None and self.ranker is None:
            raise ValueError("an app needs a retriever (a Qwen3 model), a ranker (an HSTU model) or both")
        if self.ingress.cache is not None and self.retriever is None:
            raise ValueError("ingress.cache: user vectors go to a retriever's soft token; this app has no retriever")
        return self

    def engines(self) -> dict[str, EngineSection]:
        """The app's engine sections by name ("retriever", "ranker")."""
        return {name: section for name in ("retriever", "ranker") if (section := getattr(self, name)) is not None}


def live_limits(model: type[_Args], user_config, running: _Args) -> tuple[_Args, str | None]:
    """The limits a `user_config` asks for; if it does not validate, the running ones and why. `reconfigure` must
    not raise: Serve would tear the replica down and start replacements that fail the same way (zero replicas)."""
    try:
        return model.model_validate(user_config), None
    except ValidationError as err:
        problem = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'user_config'}: {e['msg']}" for e in err.errors())
        log.error("user_config %r refused, the running limits stay (%s): %s", user_config, running, problem)
        return running, problem


def _merged(base: dict, over: dict) -> dict:
    """`over` on `base`, nested mappings merged key by key."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
