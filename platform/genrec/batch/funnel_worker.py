"""The funnel's two Ray Data stages (callable classes; nothing here imports Ray).

Stage 1, RetrieveStage: the recommend job's worker, handing each shard's results and errors on (one row per
shard) instead of committing them. Stage 2, RankStage: ranks each user's items after the user's history with
the HSTU ranker and commits the shard, its errors with stage 1's. A user the ranker refuses (no usable
history) becomes an error row; items the ranker does not know keep stage 1's place after the ranked ones.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from genrec.batch.funnel_results import ROW, funnel_table, user_spans
from genrec.batch.funnel_spec import FunnelSpec
from genrec.batch.handoff import HANDOFF, from_handoff, handoff_row
from genrec.batch.output import RECOMMENDATIONS
from genrec.batch.rank_rows import parse_rank_rows
from genrec.batch.recommend_worker import RecommendWorker
from genrec.batch.rows import Parsed, RowError
from genrec.batch.shards import InputLayout, Shard
from genrec.batch.worker import REPORT, ShardWorker
from genrec.errors import GenrecError

HISTORY_INPUT = InputLayout(required=(("history",),))


class RetrieveStage(RecommendWorker):
    def __call__(self, batch: pa.Table) -> pa.Table:
        return pa.Table.from_pylist([self.hand_on(Shard.from_row(r)) for r in batch.to_pylist()], schema=HANDOFF)

    def hand_on(self, shard: Shard) -> dict:
        if self.out.counts(shard) is not None:  # a retried task, or a late duplicate: stage 2 reports it
            return handoff_row(shard)
        return handoff_row(shard, *self.compute(shard))

    def results_table(self, user_ids: pa.Array, positions: list[int], results: list) -> pa.Table:
        table = super().results_table(user_ids, positions, results)
        rows = np.repeat(np.asarray(positions, np.int64), [len(r.items) for r in results])
        return table.append_column(ROW, pa.array(rows, pa.int64()))


class RankStage(ShardWorker):
    layout = HISTORY_INPUT
    results = RECOMMENDATIONS
    spec: FunnelSpec

    def __init__(self, spec: FunnelSpec, model_version: str, run_id: str, ranker_version: str, **execution):
        super().__init__(spec, model_version, run_id, **execution)
        self.ranker_version = ranker_version
        self.tasks = tuple(self.engine.model.config.tasks)
        self.retrieved: pa.Table | None = None  # the running shard's stage 1 results ...
        self.refused: list[RowError] = []  # ... and errors

    def model_dir(self) -> str:
        return self.spec.ranker

    def __call__(self, batch: pa.Table) -> pa.Table:
        reports = []
        for row in batch.to_pylist():
            shard, self.retrieved, errors = from_handoff(row)
            self.refused = [] if errors is None else _row_errors(errors, shard)
            reports.append(self.run(shard))
        return pa.Table.from_pylist(reports, schema=REPORT)

    def parse(self, table: pa.Table, user_ids: pa.Array) -> Parsed:
        """A RankRequest per user stage 1 has items for: the user's history, and of those items the ones the
        ranker knows (possibly none: then there is nothing to rank, but the history is still checked)."""
        if self.retrieved is None:
            raise GenrecError("stage 1 found this shard committed, and it is not: was the output changed?")
        spans = user_spans(self.retrieved.column(ROW).to_numpy())
        positions = [position for position, _, _ in spans]
        item_ids = self.retrieved.column("item_id").to_pylist()
        candidates = [[i for i in item_ids[lo:hi] if i is not None] for _, lo, hi in spans]
        take = pa.array(positions, pa.int64())
        asked = pa.table(
            {
                "user_id": user_ids.take(take),
                "history": table.column("history").combine_chunks().take(take),
                "candidates": pa.array(candidates, pa.list_(pa.string())),
            }
        )
        parsed = parse_rank_rows(asked, None)
        known = self.engine.catalog.row_of
        parsed.requests = [
            r.model_copy(update={"candidates": [c for c in r.candidates if known(c) is not None]})
            for r in parsed.requests
        ]
        parsed.positions = [positions[k] for k in parsed.positions]
        for error in parsed.errors:
            error.position = positions[error.position]
        parsed.errors += self.refused
        return parsed

    def infer(self, requests: list) -> list:
        """One rank call over the requests with something to rank; None for the others."""
        asked = [r for r in requests if r.candidates]
        ranked = iter(self.engine.rank(asked) if asked else [])
        return [next(ranked) if r.candidates else None for r in requests]

    def results_table(self, user_ids: pa.Array, positions: list[int], results: list) -> pa.Table:
        by_row = dict(zip(positions, results, strict=True))
        return funnel_table(self.retrieved, by_row, self.tasks, self.spec.rank_task, self.ranker_version)


def _row_errors(errors: pa.Table, shard: Shard) -> list[RowError]:
    """Stage 1's error rows as the shard's RowErrors (the errors table gives rows of the input file)."""
    return [RowError(e["row"] - shard.start, e["field"], e["reason"]) for e in errors.to_pylist()]
