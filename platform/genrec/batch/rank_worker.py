"""The rank job's worker: each user's history and candidates -> one `Engine.rank` call per shard."""

from __future__ import annotations

import pyarrow as pa

from genrec.batch.output import RANKINGS
from genrec.batch.rank_results import rankings_table
from genrec.batch.rank_rows import RANK_INPUT, parse_rank_rows
from genrec.batch.rows import Parsed
from genrec.batch.spec import RankSpec
from genrec.batch.worker import ShardWorker


class RankWorker(ShardWorker):
    layout = RANK_INPUT
    results = RANKINGS
    spec: RankSpec

    def parse(self, table: pa.Table, user_ids: pa.Array) -> Parsed:
        return parse_rank_rows(table, self.spec.rank_by)

    def infer(self, requests: list) -> list:
        return self.engine.rank(requests)

    def results_table(self, user_ids: pa.Array, positions: list[int], results: list) -> pa.Table:
        tasks = tuple(self.engine.model.config.tasks)
        return rankings_table(user_ids, positions, results, tasks, self.spec.rank_by, self.model_version, self.run_id)
