"""What a batch run computes (its identity) and how it executes (not part of the identity).

JobSpec holds what every sharded job shares; BatchSpec is the recommend job's, RankSpec the rank job's."""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from genrec.api import MAX_BEAM_WIDTH, MAX_SCORE_WEIGHT
from genrec.cache.config import CacheConfig
from genrec.engine_options import EngineOptions

FORMAT = 3  # bump when the output layout or columns change (3: repeated user_ids refused)


class JobSpec(EngineOptions):
    """Everything that decides a job's output: two runs with equal specs (and equal inputs) write equal files.
    The engine's options (EngineOptions: dtype, the scoring chunk, the fast path...) are part of it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="model directory")
    users: str = Field(description="users Parquet file or directory (local path or URI)")
    out: str = Field(description="output directory (local path or URI)")
    batch_size: int = Field(64, ge=1, description="users per engine call = per shard = per output file")
    device: str = "cpu"

    def identity(self, model_version: str, input_fingerprint: str) -> dict:
        """The settings a rerun must share with the first run for its output to be the same run's."""
        return {
            "format": FORMAT,
            "model_version": model_version,
            "input": input_fingerprint,
            "batch_size": self.batch_size,
            "device": self.device.split(":")[0],
            **self.engine_kwargs(),
        }


class BatchSpec(JobSpec):
    """The recommend job: retrieve (or recommend) for every user."""

    beam_width: int = Field(30, ge=1, le=MAX_BEAM_WIDTH)
    num_results: int | None = Field(None, ge=1, description="items per user (default: beam_width)")
    rank: bool = Field(False, description="recommend (retrieve, then score on the same prefill) instead of retrieve")
    rank_by: Literal["score", "joint"] = Field("score", description="with rank: RecommendRequest.rank_by")
    score_weight: float = Field(
        1.0, ge=0, le=MAX_SCORE_WEIGHT, allow_inf_nan=False, description="RecommendRequest.score_weight"
    )
    cache: CacheConfig | None = Field(None, description="user embeddings by user_id when the input has none")

    @model_validator(mode="after")
    def _results_within_beam(self):
        if self.num_results is not None and self.num_results > self.beam_width:
            raise ValueError(f"num_results ({self.num_results}) exceeds beam_width ({self.beam_width})")
        if self.rank_by != "score" and not self.rank:
            raise ValueError("rank_by applies to recommend: set rank")
        if self.score_weight != 1.0 and self.rank_by != "joint":
            raise ValueError("score_weight applies to rank_by joint")
        return self

    def identity(self, model_version: str, input_fingerprint: str) -> dict:
        return {
            **super().identity(model_version, input_fingerprint),
            "beam_width": self.beam_width,
            "num_results": self.num_results or self.beam_width,
            "rank": self.rank,
            "rank_by": self.rank_by,
            "score_weight": self.score_weight,
            "cache": self.cache.name if self.cache else None,
        }


class RankSpec(JobSpec):
    """The rank job: rank every user's given candidates with a ranking (HSTU) model."""

    rank_by: str | None = Field(
        None,
        min_length=1,
        description="a task of the model: rank each user's candidates by its probability, highest first (ties in "
        "the candidates' order); None: rank = the candidates' order",
    )

    def identity(self, model_version: str, input_fingerprint: str) -> dict:
        return {**super().identity(model_version, input_fingerprint), "job": "rank", "rank_by": self.rank_by}


def run_id_of(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


class Execution(BaseModel):
    """How the run is spread over the cluster; changing it between a run and its rerun is fine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    actors: int = Field(1, ge=1, description="engine actors in the pool (one model copy each)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per actor (0: CPU engine)")
    gpu_wait_s: float = Field(
        0.0,
        ge=0,
        description="with num_gpus, when no node has the GPUs and the autoscaler publishes no GPU node type: ask "
        "it for one and wait this long for it (0: refuse at once)",
    )
    cpus_per_actor: float = Field(0.5, gt=0, description="fractional: Ray Data's own helper tasks need room too")
    threads: int | None = Field(None, ge=1, description="torch threads per actor (default: Ray's, 1 per CPU)")
    pin_threads: bool = Field(False, description="bind each actor's threads to `threads` cores (genrec.threads; Linux)")
    kv_budget_bytes: int | None = Field(
        None, ge=1, description="each actor's KV pool (default: 4 GiB on the CPU, half the free GPU memory)"
    )
    max_error_fraction: float = Field(0.01, ge=0, le=1, description="exit non-zero above this fraction of users")
    progress: bool = Field(True, description="Ray Data progress bars")

    @model_validator(mode="after")
    def _pin_needs_threads(self):
        from genrec.threads import check_thread_settings

        check_thread_settings(self.threads, self.pin_threads, threads_name="--threads", pin_name="--pin-threads")
        return self
