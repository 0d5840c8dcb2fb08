"""run: any batch job (genrec.batch.spec) as a Ray Data pipeline over input shards, resumable and idempotent
(docs/batch.md, "What every shard job shares"); each stage (stages.stages_of) runs on an actor pool of its own,
chained in one dataset, and the last commits each shard.

Why shards and not Ray Data's read_parquet/write_parquet: Ray Data's blocks have no stable identity, and its
checkpointing resumes per write task (at small scale one task held everything). A shard is a fixed row range
with a fixed output name, committed by an atomic move, so a killed run loses only the shards in flight, a
rerun recomputes exactly the missing ones, and every shard's results depend on its rows alone.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass

from genrec.batch.connect import check_gpus, ensure_ray
from genrec.batch.output import OutputDir, ShardCounts
from genrec.batch.shards import InputLayout, Shard, UsersInput, shards_table
from genrec.batch.spec import Execution, JobSpec, RankingExecution, catalog_version_of
from genrec.batch.stages import Stage, stages_of
from genrec.batch.worker import ShardWorker
from genrec.errors import GenrecError
from genrec.model.directory import ModelDir


@dataclass
class Summary:
    users: int
    shards: int
    processed: int  # users computed by this invocation
    skipped_as_done: int  # users whose shard an earlier invocation had committed
    rows_written: int  # result rows in the output (recommendations or rankings), all invocations
    errors: int  # bad rows in the output, all invocations
    repeats: int  # input rows refused for a user_id an earlier row has (among the errors)
    error_fraction: float
    seconds: float
    first_shard_s: float | None  # until the first shard was committed: actor start, model load, one shard
    users_per_s: float  # processed / seconds
    run_id: str
    model_version: str
    out: str
    catalog_version: str | None = None  # the retriever's (the ranking job: its model's item index)
    ranker_version: str | None = None  # the funnel's ranking model
    degraded_users: int | None = None  # the funnel's: users the ranker failed for, stage 1's order kept (all runs)

    def line(self) -> str:
        return "batch summary: " + json.dumps(asdict(self))

    def failed(self, max_error_fraction: float) -> bool:
        return self.error_fraction > max_error_fraction


def run(
    spec: JobSpec,
    execution: Execution = Execution(),
    ranking: RankingExecution = RankingExecution(),
    worker: type[ShardWorker] = ShardWorker,
) -> Summary:
    """Run the job over the shards not committed yet. `ranking`: the funnel's ranking pool; `worker`: the class
    Ray Data runs (a test's may subclass it)."""
    start = time.perf_counter()
    spec.check_models()
    plan = stages_of(spec, execution, ranking)
    for _, run_on in plan:
        _check_device(spec, run_on)
    users = UsersInput(spec.users, layout_of([stage for stage, _ in plan]))
    if users.unread:
        print(f"warning: {spec.users}: no stage of this job reads column(s) {', '.join(users.unread)}", file=sys.stderr)
    version = ModelDir.open(spec.model).version
    out = OutputDir(spec.out, plan[-1][0].results)
    identity = spec.identity(version, users.fingerprint())
    run_id = out.open_run(identity)
    out.remove_stale_tmp()
    shards = users.shards(spec.batch_size)
    counts = out.committed(shards)
    skipped = sum(s.rows for s in shards if s.index in counts)
    pending = [s for s in shards if s.index not in counts]
    processed, first_shard_s = 0, None
    if pending:
        out.check_writable()
        _claim_cluster(plan, out)
        for report in _run_stages(pending, plan, run_id, worker):
            first_shard_s = first_shard_s or round(time.perf_counter() - start, 3)
            if report["skipped"]:  # committed meanwhile by a late worker of a killed run
                skipped += report["users"]
            else:
                processed += report["users"]
            counts[report["shard"]] = ShardCounts(report["rows"], report["errors"], report["degraded"])
    errors = sum(c.errors for c in counts.values())
    seconds = time.perf_counter() - start
    return Summary(
        users=users.rows,
        shards=len(shards),
        processed=processed,
        skipped_as_done=skipped,
        rows_written=sum(c.rows for c in counts.values()),
        errors=errors,
        repeats=sum(len(s.repeats) for s in shards),
        error_fraction=errors / max(users.rows, 1),
        seconds=round(seconds, 3),
        first_shard_s=first_shard_s,
        users_per_s=round(processed / seconds, 2),
        run_id=run_id,
        model_version=version,
        catalog_version=identity["catalog_version"],
        out=spec.out,
        ranker_version=identity.get("ranker_version"),
        degraded_users=sum(c.degraded for c in counts.values()) if len(plan) > 1 else None,
    )


def _claim_cluster(plan: list[tuple[Stage, Execution]], out: OutputDir) -> None:
    """Ray, only once there is work (bad input fails fast), with the GPUs every stage asks for."""
    ray = ensure_ray()
    try:
        for _, run_on in plan:
            check_gpus(ray, run_on.num_gpus, run_on.gpu_wait_s)
    except GenrecError:
        out.abandon_new_run()  # nothing ran: the rerun (e.g. with --num-gpus 0) is a new run
        raise


def _run_stages(pending: list[Shard], plan: list[tuple[Stage, Execution]], run_id: str, worker: type[ShardWorker]):
    ray = ensure_ray()
    dataset = ray.data.from_arrow([shards_table([s]) for s in pending])  # one block per shard
    dataset.context.enable_progress_bars = plan[0][1].progress  # this dataset's copy of the context
    for k, (stage, run_on) in enumerate(plan):
        stage.connect()
        # One shard per call: the shard, not the Ray Data batch, sizes the engine call.
        actors = run_on.model_copy(update={"actors": min(run_on.actors, len(pending))})
        dataset = on_actors(dataset, worker, stage, actors, 1, run_id=run_id, hand_on=k < len(plan) - 1)
    yield from dataset.iter_rows()


def on_actors(dataset, worker: type, stage: Stage, run_on: Execution, batch_size: int, **kwargs):
    """`dataset` mapped by `worker(stage, execution=run_on, catalog_version=..., **kwargs)` on an actor pool of
    run_on's size, CPUs and GPUs, in Arrow batches of `batch_size` rows (a job's and genrec.data's stages alike)."""
    from ray.data import ActorPoolStrategy

    return dataset.map_batches(
        worker,
        fn_constructor_kwargs={
            "stage": stage,
            "execution": run_on,
            "catalog_version": catalog_version_of(stage.model),  # every actor checks it serves this one
            **kwargs,
        },
        batch_size=batch_size,
        batch_format="pyarrow",
        compute=ActorPoolStrategy(size=run_on.actors),
        num_cpus=run_on.cpus_per_actor,
        num_gpus=run_on.num_gpus or None,
    )


def layout_of(stages: list[Stage]) -> InputLayout:
    """The input columns of all the stages together."""
    return InputLayout(
        required=tuple(group for stage in stages for group in stage.layout.required),
        optional=tuple(dict.fromkeys(c for stage in stages for c in stage.layout.optional)),
    )


def _check_device(spec: JobSpec, execution: Execution) -> None:
    if spec.device.startswith("cuda") != (execution.num_gpus > 0):
        raise GenrecError(
            f"device {spec.device!r} with num_gpus={execution.num_gpus}: a CUDA engine needs GPUs per actor "
            "and a CPU engine none"
        )
