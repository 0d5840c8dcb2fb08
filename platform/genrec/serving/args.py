"""The application's arguments: what a Serve config's `args` may say, validated at deploy time."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from genrec.cache.config import CacheConfig
from genrec.engine_options import EngineOptions

if TYPE_CHECKING:
    from genrec.engine import SchedulerConfig

log = logging.getLogger(__name__)


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a typo in a config file fails the deploy instead of vanishing


class EngineLimits(_Args):
    """What may change live (`user_config` -> `reconfigure`, no restart): queueing and batching limits.
    A field left out of a `user_config` is its default here, so removing it from the config reverts it."""

    max_queue: int = Field(256, ge=1, description="requests waiting in one replica's engine; beyond: 503")
    max_running: int | None = Field(None, ge=1, description="requests batched at once (default: by device)")
    prefill_tokens_per_step: int = Field(4096, ge=1)


class ReplicaOptions(EngineOptions):
    """What an engine replica is built with: the Engine's options, its scheduler's sizes and its threads
    (a change replaces the replicas)."""

    kv_budget_bytes: int | None = Field(
        None, ge=1, description="the KV pool, allocated once (default: 4 GiB on the CPU, half the free GPU memory)"
    )
    prefix_cache_bytes: int | None = Field(
        None,
        ge=0,
        description="prompts' K/V kept for reuse by later prompts with the same start (default: half "
        "the KV pool; 0: off)",
    )
    host_cache_bytes: int = Field(
        0, ge=0, description="host memory evicted prefixes spill to (CUDA; unverified on a GPU: 0, off, by default)"
    )
    torch_threads: int | None = Field(None, ge=1, description="intra-op threads of an engine replica")
    pin_threads: bool = Field(
        False, description="bind the replica's threads to torch_threads cores of its node (genrec.threads; Linux)"
    )

    @model_validator(mode="after")
    def _pin_needs_threads(self):
        from genrec.threads import check_thread_settings  # no torch import: the ingress validates these too

        names = {"threads_name": "torch_threads", "pin_name": "pin_threads"}
        check_thread_settings(self.torch_threads, self.pin_threads, **names)
        return self

    def scheduler_config(self, limits: EngineLimits = EngineLimits()) -> SchedulerConfig:
        from genrec.engine import SchedulerConfig  # here: the ingress imports these arguments without torch

        sizes = self.model_dump(include={"kv_budget_bytes", "prefix_cache_bytes", "host_cache_bytes"})
        return SchedulerConfig(**limits.model_dump(), **sizes)


class IngressSettings(_Args):
    """What the ingress is built with (a change replaces its replicas)."""

    auth_token_env: str | None = Field(
        None, description="name of the environment variable holding the bearer token; unset: no auth"
    )
    cache: CacheConfig | None = Field(None, description="resolve user_id -> user_embedding through this cache")
    retry_after_s: int = Field(1, ge=1, description="Retry-After of a 503 when the engines are overloaded")
    body_timeout_s: float = Field(
        10.0, gt=0, description="a request's whole body must arrive within this; 408 past it (frees the slot)"
    )
    routing_prefix_blocks: int = Field(
        1,
        ge=1,
        le=64,
        description="first blocks of a prompt (16 tokens or history events, 64 text characters) whose digest "
        "routes a request without user_id: more than a template every prompt opens with",
    )


class IngressLimits(_Args):
    """What may change live in the ingress (`user_config` -> `reconfigure`)."""

    request_timeout_s: float = Field(30.0, gt=0, description="deadline of a request (504 past it)")


class EngineArgs(ReplicaOptions):
    """One engine deployment: its model, replicas' options and limits, resources, scaling and router. The app's
    own fields for its main engine (EngineServer), and its `ranker` section for the funnel's ranker."""

    model_dir: str = Field(description="a genrec model directory, present on every node that runs an engine")
    device: Literal["cpu", "cuda"] = "cpu"
    limits: EngineLimits = EngineLimits()
    # Resources and scaling of the engine deployment (config files may also override them per deployment).
    engine_num_cpus: float | None = Field(None, gt=0, description="default: 1")
    engine_num_gpus: float | None = Field(None, ge=0, description="default: 1 on cuda, 0 on cpu")
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(32, gt=0, description="per engine replica, for autoscaling")
    downscale_delay_s: float = Field(
        600.0, ge=0, description="low traffic this long before an engine replica (and its prefix cache) goes"
    )
    engine_router: Literal["user", "serve_default"] = Field(
        "user",
        description="user: each user's requests to the engine replica holding their K/V (genrec.serving.router); "
        "serve_default: Serve's power-of-two-choices router",
    )
    max_ongoing_requests: int = Field(256, ge=1, description="per engine replica: they meet in its batching loop")
    max_queued_requests: int = Field(512, ge=1, description="per engine deployment handle; beyond: 503")

    @field_validator("model_dir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        """Relative to where the app is built (`serve run`'s directory), so every replica finds it."""
        return str(Path(value).expanduser().resolve())

    def replica_options(self) -> ReplicaOptions:
        return ReplicaOptions.model_validate(self.model_dump(include=set(ReplicaOptions.model_fields)))

    def engine_resources(self) -> tuple[float, float]:
        """CPUs and GPUs one engine replica reserves (a config file may still override them per deployment)."""
        gpus = self.engine_num_gpus if self.engine_num_gpus is not None else (1 if self.device == "cuda" else 0)
        return (self.engine_num_cpus if self.engine_num_cpus is not None else 1), gpus

    @model_validator(mode="after")
    def _replica_bounds(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        return self


class AppArgs(IngressSettings, IngressLimits, EngineArgs):
    """The main engine's fields (a Qwen3 retriever, or any one model) and the ingress's; with `ranker`, the
    funnel: the main engine retrieves, a second engine deployment (RankerServer, an HSTU model) ranks."""

    ranker: EngineArgs | None = Field(
        None,
        description="an HSTU ranking model in a second engine deployment, scaled on its own: /v1/recommend with "
        "a `history` ranks the retrieved items with it, /v1/rank goes to it",
    )
    ingress_num_cpus: float = Field(0.25, ge=0)
    ingress_replicas: int = Field(1, ge=1)
    ingress_max_ongoing_requests: int = Field(
        1024, ge=1, description="requests one ingress replica holds at once (a slow body holds one <= body_timeout_s)"
    )
    ingress_max_queued_requests: int = Field(2048, ge=1, description="per ingress deployment; beyond: 503")

    def ingress_settings(self) -> IngressSettings:
        return IngressSettings.model_validate(self.model_dump(include=set(IngressSettings.model_fields)))

    def ingress_limits(self) -> IngressLimits:
        return IngressLimits.model_validate(self.model_dump(include=set(IngressLimits.model_fields)))

    @model_validator(mode="after")
    def _cache_dim(self):
        if self.cache is not None and self.cache.dim is None:
            raise ValueError("cache.dim is required: the user vectors' width (the model's soft-token input size)")
        return self


def live_limits(model: type[_Args], user_config, running: _Args) -> tuple[_Args, str | None]:
    """The limits a deployment's `user_config` asks for; or, when it does not validate, the running ones and why
    it was refused. `reconfigure` must not raise on a bad config: Serve would tear the replica down and start
    replacements that fail the same way (zero replicas). A config file is checked before it is deployed by
    `python -m genrec.serving.check`."""
    try:
        return model.model_validate(user_config), None
    except ValidationError as err:
        problem = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'user_config'}: {e['msg']}" for e in err.errors())
        log.error("user_config %r refused, the running limits stay (%s): %s", user_config, running, problem)
        return running, problem
