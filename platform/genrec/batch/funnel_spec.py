"""The funnel's settings: the recommend job's (stage 1) plus the ranking model and task (stage 2), checked
against the ranker's directory when the spec is made, so that a bad one is refused before any Ray work."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from genrec.batch.rank import ranking_config
from genrec.batch.spec import BatchSpec, Execution
from genrec.errors import GenrecError
from genrec.model.directory import ModelDir


class FunnelSpec(BatchSpec):
    """Retrieve (or recommend) for every user, then rank each user's items after the user's history."""

    ranker: str = Field(description="HSTU ranking model directory")
    rank_task: str | None = Field(
        None,
        validate_default=True,
        description="a task of the ranker: the final order is by its probability, highest first (ties in stage 1's "
        "order); default: the ranker's first task",
    )

    @field_validator("ranker")
    @classmethod
    def _an_hstu_ranker(cls, ranker: str) -> str:
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
        if task is None:
            return tasks[0]
        if task not in tasks:
            raise ValueError(f"{task!r} is not a task of the ranker (its tasks: {', '.join(tasks)})")
        return task

    def identity(self, model_version_: str, input_fingerprint: str) -> dict:
        return {
            **super().identity(model_version_, input_fingerprint),
            "job": "funnel",
            "ranker_version": ModelDir.open(self.ranker).version,
            "rank_task": self.rank_task,
        }


class RankingExecution(BaseModel):
    """How the funnel's ranking stage runs: its own actor pool. GPUs per actor, threads and the KV budget are
    the run's (Execution's); like Execution, a rerun may change it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank_actors: int = Field(1, ge=1, description="ranking actors (one ranker copy each)")
    rank_cpus_per_actor: float = Field(0.5, gt=0, description="CPUs each ranking actor reserves (fractional)")

    def over(self, run: Execution) -> Execution:
        """The ranking stage's Execution: the run's, with this pool."""
        return run.model_copy(update={"actors": self.rank_actors, "cpus_per_actor": self.rank_cpus_per_actor})
