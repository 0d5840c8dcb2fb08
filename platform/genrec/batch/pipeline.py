"""run_shards: a batch job as a Ray Data pipeline over input shards, resumable and idempotent. The recommend
job (`recommend.run_batch`) and the rank job (`rank.run_rank`) are this pipeline with their own worker; the
funnel (`funnel.run_funnel`) chains two stages, each with its own actor pool (run_stages).

    plan shards, find repeated user_ids (driver)  ->  skip committed ones  ->  from_arrow(pending shards)
      -> map_batches(worker, ActorPoolStrategy): read shard, validate rows, one engine call, commit files
         (with stages: every stage but the last hands each shard's results on, one row per shard)
      -> per-shard reports  ->  summary

Why shards and not Ray Data's read_parquet/write_parquet: Ray Data's blocks have no stable identity, and its
checkpointing resumes per write task (at small scale one task held everything). A shard is a fixed row range
with a fixed output name, committed by an atomic move, so a killed run loses only the shards in flight, a
rerun recomputes exactly the missing ones, and every shard's results depend on its rows alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from genrec.batch.connect import check_gpus, ensure_ray
from genrec.batch.output import OutputDir, ShardCounts
from genrec.batch.shards import InputLayout, Shard, UsersInput, shards_table
from genrec.batch.spec import Execution, JobSpec
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
    ranker_version: str | None = None  # the funnel's ranking model

    def line(self) -> str:
        return "batch summary: " + json.dumps(asdict(self))

    def failed(self, max_error_fraction: float) -> bool:
        return self.error_fraction > max_error_fraction


@dataclass(frozen=True)
class Stage:
    """One map_batches step of the pipeline: a callable class on an actor pool of its own."""

    worker: type  # a ShardWorker, or a stage that hands its shards on to the next
    execution: Execution
    setup: Callable[[], dict] = dict  # the worker's further arguments that need Ray (called once it is up)


def run_shards(
    spec: JobSpec, execution: Execution, worker: type[ShardWorker], setup: Callable[[], dict] = dict
) -> Summary:
    """Run `worker` over the input's shards that are not committed yet. `setup()` gives the worker's further
    arguments that need Ray (called once it is up)."""
    return run_stages(spec, [Stage(worker, execution, setup)])


def run_stages(spec: JobSpec, stages: list[Stage]) -> Summary:
    """Run the stages, chained in one dataset, over the shards not committed yet; the last stage commits them
    (its `results` folder is the output's) and reports. The input must hold every stage's columns."""
    start = time.perf_counter()
    for stage in stages:
        _check_device(spec, stage.execution)
    users = UsersInput(spec.users, _layout(stages))
    version = ModelDir.open(spec.model).version
    out = OutputDir(spec.out, stages[-1].worker.results)
    run_id = out.open_run(spec.identity(version, users.fingerprint()))
    out.remove_stale_tmp()
    shards = users.shards(spec.batch_size)
    counts = out.committed(shards)
    skipped = sum(s.rows for s in shards if s.index in counts)
    pending = [s for s in shards if s.index not in counts]
    processed, first_shard_s = 0, None
    if pending:
        out.check_writable()
        ray = ensure_ray()  # only now: bad input fails fast, and a finished run needs no cluster
        try:
            for stage in stages:
                check_gpus(ray, stage.execution.num_gpus, stage.execution.gpu_wait_s)
        except GenrecError:
            out.abandon_new_run()  # nothing ran: the rerun (e.g. with --num-gpus 0) is a new run
            raise
        common = {"spec": spec, "model_version": version, "run_id": run_id}
        for report in _run_stages(pending, stages, common):
            first_shard_s = first_shard_s or round(time.perf_counter() - start, 3)
            if report["skipped"]:  # committed meanwhile by a late worker of a killed run
                skipped += report["users"]
            else:
                processed += report["users"]
            counts[report["shard"]] = ShardCounts(report["rows"], report["errors"])
    rows = sum(c.rows for c in counts.values())
    errors = sum(c.errors for c in counts.values())
    seconds = time.perf_counter() - start
    return Summary(
        users=users.rows,
        shards=len(shards),
        processed=processed,
        skipped_as_done=skipped,
        rows_written=rows,
        errors=errors,
        repeats=sum(len(s.repeats) for s in shards),
        error_fraction=errors / max(users.rows, 1),
        seconds=round(seconds, 3),
        first_shard_s=first_shard_s,
        users_per_s=round(processed / seconds, 2),
        run_id=run_id,
        model_version=version,
        out=spec.out,
    )


def _run_stages(pending: list[Shard], stages: list[Stage], common: dict):
    ray = ensure_ray()
    from ray.data import ActorPoolStrategy

    dataset = ray.data.from_arrow([shards_table([s]) for s in pending])  # one block per shard
    dataset.context.enable_progress_bars = stages[0].execution.progress  # this dataset's copy of the context
    for stage in stages:
        run = stage.execution
        dataset = dataset.map_batches(
            stage.worker,
            fn_constructor_kwargs={
                **common,
                **stage.setup(),
                "threads": run.threads,
                "pin_threads": run.pin_threads,
                "kv_budget_bytes": run.kv_budget_bytes,
            },
            batch_size=1,  # one shard per call: the shard, not the Ray Data batch, sizes the engine call
            batch_format="pyarrow",
            compute=ActorPoolStrategy(size=min(run.actors, len(pending))),
            num_cpus=run.cpus_per_actor,
            num_gpus=run.num_gpus or None,
        )
    yield from dataset.iter_rows()


def _layout(stages: list[Stage]) -> InputLayout:
    """The input columns of all the stages together."""
    layouts = [stage.worker.layout for stage in stages]
    return InputLayout(
        required=tuple(group for layout in layouts for group in layout.required),
        optional=tuple(dict.fromkeys(c for layout in layouts for c in layout.optional)),
    )


def _check_device(spec: JobSpec, execution: Execution) -> None:
    on_gpu = spec.device.startswith("cuda")
    if on_gpu != (execution.num_gpus > 0):
        raise GenrecError(
            f"device {spec.device!r} with num_gpus={execution.num_gpus}: a CUDA engine needs GPUs per actor "
            "and a CPU engine none"
        )
