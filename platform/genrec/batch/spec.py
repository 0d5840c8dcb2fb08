"""What a batch run computes (its spec: a rerun must have the same identity) and how it executes (Execution).
One spec per job kind: RecommendSpec, FunnelSpec (that, then the HSTU ranker), RankSpec; their fields are the
jobs' flags."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Annotated, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from genrec.api import MAX_BEAM_WIDTH, MAX_SCORE_WEIGHT, Float, Int, Switch
from genrec.cache.config import CacheConfig
from genrec.catalog.catalog import catalog_version
from genrec.engine_options import ON_HSTU, EngineOptions
from genrec.errors import GenrecError, ModelDirectoryError
from genrec.model.config import HSTU_MODEL_TYPE, HSTUConfig
from genrec.model.directory import GENREC_SUBDIR, ModelDir
from genrec.threads import ThreadSettings

FORMAT = 4  # bump when the output layout or columns change (3: repeated user_ids refused; 4: catalog_version)
# The funnel's own (4: degraded; 5: catalog_version; 6: stage 1 as online: candidates without --score, every beam
# ranked, num_results items kept).
FUNNEL_FORMAT = 6
WRONG_FAMILY = {  # a job's refusal of the other family's model directory
    "qwen3": "an HSTU ranking model (it ranks given candidates: jobs/batch_rank.py); batch recommendation needs a "
    "Qwen3 semantic-ID model",
    "hstu": f"not an HSTU ranking model (config.json model_type is not {HSTU_MODEL_TYPE!r}); batch ranking needs "
    "one (a Qwen3 semantic-ID model recommends: jobs/batch_recommend.py)",
}


def catalog_version_of(model: str) -> str | None:
    """The model directory's catalog version (None where it has no catalog: the job refuses it at its check)."""
    path = ModelDir.catalog_path_of(model)
    return catalog_version(path) if path.is_file() else None


class StageSpec(EngineOptions):
    """What a stage computes, on any input (a job's shards, or a Dataset's rows: genrec.data): its model, engine
    options and the settings of its requests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="model directory")
    device: str = "cpu"  # not a flag: the CUDA engine with GPUs per actor

    @field_validator("model")
    @classmethod
    def _absolute_model(cls, path: str) -> str:
        return absolute(path)

    def check_models(self) -> None:
        """Refuse, before any work, a model directory of the other family or one that fails `ModelDir.check`."""


class JobSpec(StageSpec):
    """Everything that decides a job's output (engine options included): equal specs and inputs, equal files."""

    users: str = Field(min_length=1, description="users Parquet file or directory (local path or URI)")
    out: str = Field(min_length=1, description="output directory (local path or URI)")
    batch_size: Int = Field(64, ge=1, description="users per engine call = per shard = per output file")

    def identity(self, model_version: str, input_fingerprint: str) -> dict:
        """The settings a rerun must share with the first run for its output to be the same run's."""
        return {
            "format": FORMAT,
            "model_version": model_version,
            "catalog_version": catalog_version_of(self.model),  # a new catalog: a new run, never mixed rows
            "input": input_fingerprint,
            "batch_size": self.batch_size,
            "device": self.device.split(":")[0],
            **self.engine_kwargs(),
        }

    @field_validator("users", "out")
    @classmethod
    def _absolute(cls, path: str) -> str:
        return absolute(path)


class RecommendStage(StageSpec):
    """Retrieve (or with `score` recommend) for every user: the settings of the recommend job and of
    genrec.data.Recommend."""

    beam_width: Int = Field(30, ge=1, le=MAX_BEAM_WIDTH, description="beams of the constrained beam search")
    beam_widths: list[Annotated[Int, Field(ge=1, le=MAX_BEAM_WIDTH)]] | None = Field(
        None, min_length=1, description="a beam width per code level, e.g. 32,128,256 (beam_width is the last)"
    )
    num_results: Int | None = Field(
        None,
        ge=1,
        description="codes per user, all their items (default: beam_width); with --ranker, the items per user kept "
        "after ranking every beam, as online (default: all)",
    )
    score: Switch = Field(False, description="recommend: label-score the retrieved and the given items, one prefill")
    order_by: Literal["score", "joint"] = Field(
        "score", description="with score: by the label's logprob, or by the item's + score_weight * the label's"
    )
    score_weight: Float = Field(
        1.0,
        ge=0,
        le=MAX_SCORE_WEIGHT,
        description="with order_by joint: the label's weight",
    )
    cache: CacheConfig | None = Field(None, description="user embeddings by user_id when the input has none")

    @field_validator("cache")
    @classmethod
    def _absolute_store(cls, cache: CacheConfig | None) -> CacheConfig | None:
        return cache if cache is None else with_absolute_store(cache)

    @model_validator(mode="before")
    @classmethod
    def _width_of_the_schedule(cls, data):
        """beam_width, when not given, is the schedule's last width."""
        widths = data.get("beam_widths") if isinstance(data, dict) else None
        if isinstance(widths, list) and widths and "beam_width" not in data:
            last = widths[-1].item() if isinstance(widths[-1], np.generic) else widths[-1]
            if isinstance(last, int) and not isinstance(last, bool):  # else beam_widths' own error names it
                return {**data, "beam_width": last}
        return data

    @model_validator(mode="after")
    def _consistent(self):
        if self.beam_widths is not None and self.beam_width != self.beam_widths[-1]:
            raise ValueError(f"beam_width ({self.beam_width}) differs from the last of beam_widths")
        if self.num_results is not None and self.num_results > self.beam_width:
            raise ValueError(f"num_results ({self.num_results}) exceeds beam_width ({self.beam_width})")
        if self.order_by != "score" and not self.score:
            raise ValueError("order_by applies to recommend: set score")
        if self.score_weight != 1.0 and self.order_by != "joint":
            raise ValueError("score_weight applies to order_by joint")
        return self

    @property
    def retrieved_codes(self) -> int | None:
        """Codes each user's beam search returns: `num_results` (None: every beam)."""
        return self.num_results

    def check_models(self) -> None:
        model_dir(self.model, "qwen3").check()


class RecommendSpec(RecommendStage, JobSpec):
    """The recommend job: its stage's settings over a users input, into an output directory."""

    def identity(self, model_version: str, input_fingerprint: str) -> dict:
        # "rank", "rank_by": score's and order_by's names before (their old flags are gone: docs/CHANGELOG.md); kept
        # as the identity's keys, so that the run_ids of earlier runs stay the same.
        return {
            **super().identity(model_version, input_fingerprint),
            "beam_width": self.beam_width,
            **({"beam_widths": self.beam_widths} if self.beam_widths else {}),  # absent: run_ids stay as before
            "num_results": self.num_results or self.beam_width,
            "rank": self.score,
            "rank_by": self.order_by,
            "score_weight": self.score_weight,
            "cache": self.cache.name if self.cache else None,
        }


class FunnelStage(RecommendStage):
    """The funnel: the recommend in beam order (with `score`, the label's), then the ranker over each user's items."""

    ranker: str = Field(description="HSTU ranking model: a second stage ranks each user's items after its history")
    rank_task: str | None = Field(
        None, validate_default=True, description="a task of the ranker: the final order (default: its first)"
    )

    @property
    def retrieved_codes(self) -> None:
        """Every beam: the ranker, not the beam order, decides which `num_results` items are kept (as online)."""
        return None

    @field_validator("ranker")
    @classmethod
    def _an_hstu_ranker(cls, ranker: str) -> str:
        ranker = absolute(ranker)
        try:
            ranking_config(ranker)
        except GenrecError as err:
            raise ValueError(str(err)) from None
        return ranker

    @field_validator("rank_task")
    @classmethod
    def _a_task_of_the_ranker(cls, task: str | None, info: ValidationInfo) -> str | None:
        if "ranker" not in info.data:  # the ranker was refused: that is the error
            return task
        tasks = ranking_config(info.data["ranker"]).tasks
        if task is not None and task not in tasks:
            raise ValueError(f"{task!r} is not a task of the ranker (its tasks: {', '.join(tasks)})")
        return task or tasks[0]

    def check_models(self) -> None:
        super().check_models()
        model_dir(self.ranker, "hstu").check()


class FunnelSpec(FunnelStage, RecommendSpec):
    """The funnel job."""

    applies_to: ClassVar[str] = "the ranking stage"  # what its own flags are for (without --ranker: refused)

    def identity(self, model_version: str, input_fingerprint: str) -> dict:
        ranker = {"job": "funnel", "ranker_version": ModelDir.open(self.ranker).version, "rank_task": self.rank_task}
        kept = {"num_results": self.num_results}  # items after ranking (None: all), not codes
        return {**super().identity(model_version, input_fingerprint), **ranker, **kept, "format": FUNNEL_FORMAT}


class RankStage(StageSpec):
    """Rank every user's given candidates with a ranking (HSTU) model: the settings of the rank job and of
    genrec.data.Rank."""

    rank_by: str | None = Field(
        None, min_length=1, description="a task of the model: the order, ties in the candidates' (default: theirs)"
    )

    @model_validator(mode="after")
    def _no_decoder_option(self):
        name = self.decoder_option_set()
        if name:
            raise ValueError(f"{name} {ON_HSTU.format(model='a ranking model')}")
        return self

    def check_models(self) -> None:
        directory = model_dir(self.model, "hstu")
        directory.check()
        tasks = directory.config.tasks
        if self.rank_by is not None and self.rank_by not in tasks:
            raise GenrecError(f"rank_by {self.rank_by!r} is not a task of the model (its tasks: {', '.join(tasks)})")


class RankSpec(RankStage, JobSpec):
    """The rank job."""

    def identity(self, model_version: str, input_fingerprint: str) -> dict:
        return {**super().identity(model_version, input_fingerprint), "job": "rank", "rank_by": self.rank_by}


def model_dir(path: str, family: str) -> ModelDir:
    """The model directory, if of `family` (and an HSTU one with its catalog); else one clear error."""
    directory = ModelDir.open(path)
    if directory.family != family:
        raise ModelDirectoryError(directory.path, WRONG_FAMILY[family])
    if family == "hstu" and not directory.catalog_path.exists():
        raise ModelDirectoryError(directory.path, f"{GENREC_SUBDIR}/catalog.parquet is missing (the item catalog)")
    return directory


def ranking_config(model: str) -> HSTUConfig:
    return model_dir(model, "hstu").config


def absolute(path: str) -> str:
    """A local path made absolute on the driver (`~` expanded; a URI left as it is): the actors run in another
    working directory, maybe on another node, and must find the same file."""
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


def run_id_of(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


class Execution(ThreadSettings):
    """How the run is spread over the cluster (threads included); a rerun may change it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    actors: Int = Field(1, ge=1, description="engine actors in the pool (one model copy each)")
    num_gpus: Float = Field(0.0, ge=0, description="GPUs per actor (0: the CPU engine)")
    gpu_wait_s: Float = Field(
        0.0,
        ge=0,
        description="when no node has the GPUs, nor a node type of the autoscaler (ray up): ask it for one, "
        "wait this long (0: refuse at once)",
    )
    cpus_per_actor: Float = Field(0.5, gt=0, description="fractional: Ray Data's own helper tasks need room too")
    kv_budget_bytes: Int | None = Field(None, ge=1, description="each actor's KV pool (default: by device)")
    max_error_fraction: Float = Field(0.01, ge=0, le=1, description="exit 1 above this fraction of bad rows")
    progress: Switch = Field(True, description="Ray Data progress bars")


class RankingExecution(BaseModel):
    """The funnel's ranking stage's own actor pool; GPUs per actor, threads and the KV budget are the run's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank_actors: Int = Field(1, ge=1, description="ranking actors (one ranker copy each)")
    rank_cpus_per_actor: Float = Field(0.5, gt=0, description="CPUs each ranking actor reserves (fractional)")

    def over(self, run: Execution) -> Execution:
        """The ranking stage's Execution: the run's, with this pool."""
        return run.model_copy(update={"actors": self.rank_actors, "cpus_per_actor": self.rank_cpus_per_actor})


def with_absolute_store(cache: CacheConfig) -> CacheConfig:
    """The cache's SQLite file made absolute on the driver, as the job's other paths are (`absolute`)."""
    return cache.model_copy(update={"store_path": absolute(cache.store_path)})
