"""The recommend job's worker: prompts (and embeddings, from the rows or the cache) -> retrieve or recommend."""

from __future__ import annotations

import pyarrow as pa

from genrec.batch.output import RECOMMENDATIONS
from genrec.batch.results import recommendations_table
from genrec.batch.rows import RECOMMEND_INPUT, Parsed, parse_rows
from genrec.batch.spec import BatchSpec
from genrec.batch.user_embeddings import lookup
from genrec.batch.worker import ShardWorker


class RecommendWorker(ShardWorker):
    layout = RECOMMEND_INPUT
    results = RECOMMENDATIONS
    spec: BatchSpec

    def __init__(self, spec: BatchSpec, model_version: str, run_id: str, cache=None, **execution):
        super().__init__(spec, model_version, run_id, **execution)
        self.cache = cache

    def parse(self, table: pa.Table, user_ids: pa.Array) -> Parsed:
        embeddings = None
        if self.cache is not None and "user_embedding" not in table.column_names:
            embeddings = lookup(self.cache, user_ids.to_pylist())
        spec = self.spec
        ranking = {"rank_by": spec.rank_by, "score_weight": spec.score_weight}
        return parse_rows(table, spec.rank, spec.beam_width, spec.num_results, embeddings, ranking)

    def infer(self, requests: list) -> list:
        return (self.engine.recommend if self.spec.rank else self.engine.retrieve)(requests)

    def results_table(self, user_ids: pa.Array, positions: list[int], results: list) -> pa.Table:
        return recommendations_table(user_ids, positions, results, self.spec.rank, self.model_version, self.run_id)
