"""A stage's engine in an actor (`StageEngine`: genrec.data's stages run it on a Dataset's batches) and the Ray Data
callable class that runs any stage of a batch job on whole shards (`ShardWorker`), one Engine per actor (no Ray
import here). A shard is run through the engine in ONE call, so its results depend on the shard alone, never on
scheduling. A stage that hands on (the funnel's first) commits nothing: each shard's results and errors go on as one
row of Arrow IPC bytes (one row stays one shard whatever Ray Data does with blocks, and the tables keep their exact
schema); no tables: the stage found the shard committed.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from genrec.batch.output import OutputDir
from genrec.batch.shards import SHARD_SCHEMA, Shard, UsersInput
from genrec.batch.spec import Execution
from genrec.batch.stages import Rows, Stage
from genrec.batch.tables import ROW, RowError, Versions, errors_table
from genrec.errors import GenrecError

REPORT = pa.schema(
    [*((name, pa.int64()) for name in ("shard", "users", "rows", "errors", "degraded")), ("skipped", pa.bool_())]
)
HANDOFF = pa.schema([*SHARD_SCHEMA, ("results", pa.large_binary()), ("errors", pa.large_binary())])


class StageEngine:
    """A stage and its Engine in one process (an actor of a job's pool or of a genrec.data stage's): the threads
    applied before the model loads, the catalog checked; `compute` turns input rows into the stage's rows."""

    def __init__(self, stage: Stage, execution: Execution = Execution(), catalog_version: str | None = None):
        """`execution`: its threads and KV budget are the actor's; `catalog_version`: the one the driver found at
        the run's start (None: not checked)."""
        from genrec.engine import Engine, SchedulerConfig

        # Before the model loads, so that torch's threads start on their cores.
        self.threads = execution.apply(threads_name="--threads", pin_name="--pin-threads")
        self.stage, spec = stage, stage.spec
        # No prefix cache: a shard's results must depend on its rows alone, not on the shards before it.
        scheduler = SchedulerConfig(kv_budget_bytes=execution.kv_budget_bytes, prefix_cache_bytes=0)
        self.engine = Engine.from_pretrained(
            stage.model, device=spec.device, scheduler=scheduler, **stage.engine_kwargs()
        )
        if catalog_version is not None and self.engine.catalog.version != catalog_version:
            raise GenrecError(
                f"{stage.model}: its catalog changed during the run (version {catalog_version} at the start, "
                f"{self.engine.catalog.version} now); one run never mixes catalog versions: rerun into another --out"
            )

    @property
    def versions(self) -> Versions:
        return Versions(self.engine.model_version, self.engine.catalog.version)

    def compute(
        self, rows: Rows, earlier: list[RowError] = (), refused: dict[int, str] | None = None, hand_on: bool = False
    ) -> tuple[pa.Table, list[RowError]]:
        """The rows' results table and their errors, in row order; a request that fails (any exception) is a row
        error, never more. `earlier`: the stage before's errors; `refused`: row -> why it is refused before it
        runs (a repeat); `hand_on`: each result row names its user's row (ROW) for the next stage."""
        parsed = self.stage.parse(rows)
        parsed.errors += earlier
        _refuse(parsed, refused or {})
        positions, results = [], []
        outcomes = self.stage.infer(self.engine, parsed.requests) if parsed.requests else []
        for position, outcome in zip(parsed.positions, outcomes, strict=True):
            if isinstance(outcome, Exception):
                parsed.errors.append(RowError.of(position, outcome))
            else:
                positions.append(position)
                results.append(outcome)
        table = self.stage.table(rows, positions, results)
        if hand_on:  # the next stage finds each item's user by its row
            of_item = np.repeat(np.asarray(positions, np.int64), [len(r.items) for r in results])
            table = table.append_column(ROW, pa.array(of_item, pa.int64()))
        return table, sorted(parsed.errors, key=lambda e: e.position)


class ShardWorker(StageEngine):
    """A job's Ray Data callable class: whole shards, each committed to the output (or handed on)."""

    def __init__(
        self,
        stage: Stage,
        run_id: str,
        hand_on: bool = False,
        execution: Execution = Execution(),
        catalog_version: str | None = None,
    ):
        """`hand_on`: hand the shards on to the next stage."""
        super().__init__(stage, execution, catalog_version)
        self.run_id, self.hand_on = run_id, hand_on
        self.users = UsersInput(stage.spec.users, stage.layout)
        self.out = OutputDir(stage.spec.out, stage.results)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = [self.run(*_from_row(row)) for row in batch.to_pylist()]
        return pa.Table.from_pylist(rows, schema=HANDOFF if self.hand_on else REPORT)

    def run(self, shard: Shard, handed: tuple | None = None) -> dict:
        """The shard's report once committed (or, handing on, the next stage's row); `handed`: (results, errors)."""
        done = self.out.counts(shard)  # a retried task, or a late duplicate of a shard
        if self.hand_on:  # a committed shard: nothing to hand on, the last stage reports it
            results, errors = (None, None) if done is not None else map(to_ipc, self.compute_shard(shard))
            return {**shard.as_row(), "results": results, "errors": errors}
        skipped = done is not None
        if not skipped:
            done = self.out.commit(shard, *self.compute_shard(shard, handed))
        counts = {"rows": done.rows, "errors": done.errors, "degraded": done.degraded}
        return {"shard": shard.index, "users": shard.rows, **counts, "skipped": skipped}

    def compute_shard(self, shard: Shard, handed: tuple | None = None) -> tuple[pa.Table, pa.Table]:
        """The shard's (results, errors) tables."""
        rows = Rows(self.users.read(shard), self.versions, self.run_id, handed and handed[0])
        earlier = []
        if handed and handed[1] is not None:  # the stage before's errors
            earlier = [RowError(e["row"] - shard.start, e["field"], e["reason"]) for e in handed[1].to_pylist()]
        refused = {r.position: r.reason for r in shard.repeats}
        table, errors = self.compute(rows, earlier, refused, self.hand_on)
        return table, errors_table(rows.user_ids, errors, shard.start, self.run_id)


def _refuse(parsed, refused: dict[int, str]) -> None:
    """The refused rows (a repeat's: field user_id, naming the user's row) as errors, in place of a request or
    another error."""
    if not refused:
        return
    kept = [(q, p) for q, p in zip(parsed.requests, parsed.positions, strict=True) if p not in refused]
    parsed.requests, parsed.positions = [q for q, _ in kept], [p for _, p in kept]
    parsed.errors = [e for e in parsed.errors if e.position not in refused]
    parsed.errors += [RowError(position, "user_id", reason) for position, reason in refused.items()]


def _from_row(row: dict) -> tuple[Shard, tuple | None]:
    """A shard descriptor, and what the stage before handed on with it (None: the first stage's)."""
    shard = Shard.from_row({name: row[name] for name in SHARD_SCHEMA.names})
    return shard, (from_ipc(row["results"]), from_ipc(row["errors"])) if "results" in row else None


def to_ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def from_ipc(data: bytes | None) -> pa.Table | None:
    return None if data is None else pa.ipc.open_stream(data).read_all()
