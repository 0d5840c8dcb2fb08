"""A batch job's shard worker called in-process (no Ray), as Ray Data calls it, on the one shard of a small input."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from genrec.batch.output import OutputDir
from genrec.batch.shards import Shard, UsersInput
from genrec.batch.worker import ShardWorker


def run_in_process(job) -> tuple[Shard, ShardWorker, dict]:
    """(the shard, the worker, its report) after a worker of `job` ran the input's only shard."""
    (shard,) = UsersInput(job.spec.users, job.layout).shards(job.spec.batch_size)
    OutputDir(job.spec.out, job.results).open_run({})
    worker = ShardWorker(job, run_id="r")
    return shard, worker, run_shard(worker, shard)


def run_shard(worker, shard: Shard) -> dict:
    (report,) = worker(pa.Table.from_pylist([shard.as_row()])).to_pylist()
    return report


def error_rows(out: str, shard: Shard) -> list[tuple]:
    """The shard's error rows as (row, field, user_id); each must give a reason."""
    errors = pq.read_table(Path(out) / "errors" / shard.name).to_pylist()
    assert all(e["reason"] and e["run_id"] == "r" for e in errors), errors
    return [(e["row"], e["field"], e["user_id"]) for e in errors]
