"""The Ray Data callable class of a genrec.data stage (no Ray import here): a batch of the caller's rows in, the
stage's rows out, through the batch jobs' own stage and engine (genrec.batch.worker.StageEngine). A row the stage
refuses or fails comes out as a row of its own with its error, never as a failure of the pipeline.

A first stage that hands on (the funnel's) emits one row per batch holding, as Arrow IPC bytes, the batch's input
rows, its results and its errors: one row stays one batch whatever Ray Data does with blocks, and the next stage
reads the users' histories from it."""

from __future__ import annotations

import pyarrow as pa

from genrec.batch.shards import InputLayout
from genrec.batch.spec import Execution
from genrec.batch.stages import Rows, Stage
from genrec.batch.tables import RowError
from genrec.batch.worker import StageEngine, from_ipc, to_ipc
from genrec.errors import GenrecError

HANDED = ("rows", "results", "errors")  # a hand-off row's columns: IPC bytes each
ERROR_COLUMNS = (("error_field", pa.string()), ("error_reason", pa.string()))


class DatasetStage(StageEngine):
    def __init__(
        self,
        stage: Stage,
        execution: Execution,
        run_id: str,
        layout: InputLayout,
        hand_on: bool = False,
        catalog_version: str | None = None,
    ):
        """`layout`: the columns every stage of the pipeline reads (the first hands them on); `hand_on`: a later
        stage takes this one's results."""
        super().__init__(stage, execution, catalog_version)
        self.run_id, self.layout, self.hand_on = run_id, layout, hand_on

    def __call__(self, batch: pa.Table) -> pa.Table:
        if HANDED[0] in batch.column_names:  # the stage before's hand-off rows, one per batch of users
            return pa.concat_tables([self._run(*map(from_ipc, row.values())) for row in batch.to_pylist()])
        return self._run(_users(batch, self.layout))

    def _run(self, table: pa.Table, handed: pa.Table | None = None, earlier: pa.Table | None = None) -> pa.Table:
        rows = Rows(table, self.versions, self.run_id, handed)
        before = [RowError(e["row"], e["field"], e["reason"]) for e in earlier.to_pylist()] if earlier else []
        results, errors = self.compute(rows, before, hand_on=self.hand_on)
        if self.hand_on:
            mine = _errors(errors)
            return pa.table({name: [to_ipc(t)] for name, t in zip(HANDED, (table, results, mine), strict=True)})
        # The run only: which model a column names differs by stage (the funnel's last one runs the ranker).
        return with_error_rows(results, rows.user_ids, errors, {"run_id": self.run_id})


def with_error_rows(
    results: pa.Table, user_ids: pa.Array, errors: list[RowError], stamps: dict | None = None
) -> pa.Table:
    """The results, their error columns null, then a row per error: its user_id, the field at fault and why, the
    `stamps` (column -> value: the run that made it), every other column null; one schema for every
    batch."""
    good = results
    for name, kind in ERROR_COLUMNS:
        good = good.append_column(pa.field(name, kind), pa.nulls(len(results), kind))
    columns = {field.name: pa.nulls(len(errors), field.type) for field in results.schema}
    columns |= {
        name: pa.array([value] * len(errors), results.schema.field(name).type) for name, value in (stamps or {}).items()
    }
    columns["user_id"] = user_ids.take(pa.array([e.position for e in errors], pa.int64()))
    columns["error_field"] = pa.array([e.field for e in errors], pa.string())
    columns["error_reason"] = pa.array([e.reason for e in errors], pa.string())
    return pa.concat_tables([good, pa.table(columns, schema=good.schema)])


def _users(batch: pa.Table, layout: InputLayout) -> pa.Table:
    """The columns the stages read of a batch; a batch without `user_id` or a required column is the pipeline's
    mistake (every batch would fail), so it fails with one line naming the column."""
    names = batch.column_names
    if "user_id" not in names:
        raise GenrecError(f"genrec.data: the dataset has no column 'user_id' (it has {names})")
    kind = batch.schema.field("user_id").type
    usable = (pa.types.is_integer, pa.types.is_string, pa.types.is_large_string, pa.types.is_null)  # null: none given
    if not any(is_kind(kind) for is_kind in usable):
        raise GenrecError(f"genrec.data: column 'user_id' must hold integers or strings, not {kind}")
    missing = layout.missing(names)
    if missing:
        raise GenrecError(f"genrec.data: the dataset needs a column {' or '.join(map(repr, missing))} (has {names})")
    return batch.select(layout.columns(names))


def _errors(errors: list[RowError]) -> pa.Table:
    return pa.table(
        {
            "row": pa.array([e.position for e in errors], pa.int64()),
            "field": pa.array([e.field for e in errors], pa.string()),
            "reason": pa.array([e.reason for e in errors], pa.string()),
        }
    )
