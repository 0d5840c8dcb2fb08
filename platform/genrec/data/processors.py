"""genrec as a stage of a Ray Data pipeline the caller owns, in the shape of `ray.data.llm`'s processors: build one
with the batch jobs' settings, then map any Dataset of user rows with it (docs/batch.md, "genrec in your own
pipeline"):

    recommend = genrec.data.Recommend(model="/models/sid", beam_width=50, num_results=10)
    recommendations = recommend(ray.data.read_parquet("s3://bucket/users/"))

The stages, their row rules and their output columns are the jobs' (genrec.batch.stages); each bad row comes out as
a row with `error_field` and `error_reason` set. The jobs add what a pipeline of the caller's cannot have: resumable
shards, one output per run identity, repeated user_ids refused across the whole input.
"""

from __future__ import annotations

from genrec.batch.connect import check_gpus, ensure_ray
from genrec.batch.pipeline import layout_of, on_actors
from genrec.batch.spec import (
    FORMAT,
    Execution,
    FunnelStage,
    RankingExecution,
    RankStage,
    RecommendStage,
    StageSpec,
    run_id_of,
)
from genrec.batch.stages import stages_of
from genrec.data.worker import DatasetStage
from genrec.errors import GenrecError
from genrec.model.directory import ModelDir

JOBS_ONLY = ("max_error_fraction", "progress")  # Execution's settings of a job's driver, not of a stage
POOL = (*(f for f in Execution.model_fields if f not in JOBS_ONLY), *RankingExecution.model_fields, "batch_size")


class _Processor:
    """A stage built from keyword settings: the stage's (its spec's fields) and its actors' (POOL)."""

    def __init__(self, model: str, **settings):
        for name in JOBS_ONLY:
            if name in settings:
                raise GenrecError(f"genrec.data: {name} applies to the batch jobs, not to a stage of a pipeline")
        pool = {name: settings.pop(name) for name in POOL if name in settings}
        self.batch_size = pool.pop("batch_size", 64)
        if not isinstance(self.batch_size, int) or isinstance(self.batch_size, bool) or self.batch_size < 1:
            raise GenrecError(f"genrec.data: batch_size={self.batch_size!r}: users per engine call, 1 or more")
        ranking = {name: pool.pop(name) for name in RankingExecution.model_fields if name in pool}
        self.execution, self.ranking = Execution(**pool), RankingExecution(**ranking)
        device = "cuda" if self.execution.num_gpus > 0 else "cpu"
        self.spec = self.spec_type(settings)(model=model, device=device, **settings)
        self.spec.check_models()

    def spec_type(self, settings: dict) -> type[StageSpec]:
        raise NotImplementedError

    def __call__(self, dataset):
        """`dataset` (a ray.data.Dataset of user rows) mapped to the stage's rows: lazily, as Ray Data maps."""
        ray = ensure_ray()
        plan = stages_of(self.spec, self.execution, self.ranking)
        layout = layout_of([stage for stage, _ in plan])
        identity = {"format": FORMAT, "model_version": ModelDir.open(self.spec.model).version}
        run_id = run_id_of(identity | self.spec.model_dump(mode="json"))
        for k, (stage, run_on) in enumerate(plan):
            check_gpus(ray, run_on.num_gpus, run_on.gpu_wait_s)
            stage.connect()
            batch_size = self.batch_size if k == 0 else 1  # a later stage: one hand-off row per batch of users
            hand_on = k < len(plan) - 1
            dataset = on_actors(
                dataset, DatasetStage, stage, run_on, batch_size, run_id=run_id, layout=layout, hand_on=hand_on
            )
        return dataset


class Recommend(_Processor):
    """Each user's recommendations: the recommend job's settings (`beam_width`, `num_results`, `score`, `cache`,
    filters and candidates from the rows...), with `ranker` the funnel's; and its actors' (`actors`, `num_gpus`,
    `cpus_per_actor`, `threads`, `kv_budget_bytes`, `rank_actors`, `batch_size`...)."""

    def spec_type(self, settings: dict) -> type[StageSpec]:
        return FunnelStage if "ranker" in settings else RecommendStage


class Rank(_Processor):
    """Each user's given candidates ranked after the user's history by an HSTU model: the rank job's settings
    (`rank_by`) and its actors'."""

    def spec_type(self, settings: dict) -> type[StageSpec]:
        return RankStage
