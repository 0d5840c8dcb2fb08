"""Stage 1's rows and the ranker's results -> the funnel's output table: stage 1's columns, `retrieval_rank`
(stage 1's order), one `prob_<task>` column per ranker task, and `rank` in the final order.

The final order of a user's items: the ranked ones by the rank task's probability, highest first, ties in
stage 1's order; then the items the ranker does not know, in stage 1's order, with null probabilities.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from genrec.api import RankResult
from genrec.batch.rank_results import TASK_PREFIX
from genrec.batch.results import output_schema

ROW = "shard_row"  # in stage 1's table: the shard row of each item's user (dropped from the output)


def funnel_schema(user_id: pa.DataType, tasks: tuple[str, ...]) -> pa.Schema:
    fields = []
    for field in output_schema(user_id):
        if field.name == "model_version":
            fields += [pa.field(TASK_PREFIX + task, pa.float64()) for task in tasks]  # null: unknown to the ranker
        fields.append(field)
        if field.name == "rank":
            fields.append(pa.field("retrieval_rank", pa.int32()))  # stage 1's rank
        elif field.name == "model_version":
            fields.append(pa.field("ranker_version", pa.string()))
    return pa.schema(fields)


def funnel_table(
    retrieved: pa.Table,
    results: dict[int, RankResult | None],
    tasks: tuple[str, ...],
    rank_task: str,
    ranker_version: str,
) -> pa.Table:
    """`retrieved`: stage 1's rows (with ROW), each user's together in stage 1's order. `results`: shard row ->
    the RankResult of that user's known items (in stage 1's order; None: the ranker knew none). Users left
    out of `results` (refused by the ranker) are left out of the output."""
    item_ids = retrieved.column("item_id").to_pylist()
    order, scores, counts = [], [], []
    for position, lo, hi in user_spans(retrieved.column(ROW).to_numpy()):
        if position not in results:
            continue
        ranked, unknown = _final_order(item_ids, lo, hi, results[position], rank_task)
        order += [i for i, _ in ranked] + unknown
        scores += [s for _, s in ranked] + [None] * len(unknown)
        counts.append(hi - lo)
    table = retrieved.take(pa.array(order, pa.int64()))
    first_of_user = np.repeat(np.cumsum(counts) - counts, counts).astype(np.int64)
    columns = {
        **{name: table.column(name) for name in table.column_names if name != ROW},
        "rank": pa.array(np.arange(len(order)) - first_of_user + 1, pa.int32()),
        "retrieval_rank": table.column("rank"),
        **{TASK_PREFIX + t: pa.array([None if s is None else s[t] for s in scores], pa.float64()) for t in tasks},
        "ranker_version": pa.array([ranker_version] * len(order), pa.string()),
    }
    schema = funnel_schema(retrieved.schema.field("user_id").type, tasks)
    return pa.table([columns[name] for name in schema.names], schema=schema)


def user_spans(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """(shard row, first, end) of each user's run of stage 1 rows."""
    if not len(rows):
        return []
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
    ends = np.r_[starts[1:], len(rows)]
    return [(int(rows[s]), int(s), int(e)) for s, e in zip(starts, ends, strict=True)]


def _final_order(item_ids: list, lo: int, hi: int, result: RankResult | None, rank_task: str):
    """([(row, scores)] of the ranked items best first, [row] of the others). The result's items are the
    user's known items in stage 1's order: a subsequence of item_ids[lo:hi] (an unknown ID is never a known one)."""
    ranked, unknown, items = [], [], result.items if result else []
    for i in range(lo, hi):
        if len(ranked) < len(items) and items[len(ranked)].item_id == item_ids[i]:
            ranked.append((i, items[len(ranked)].scores))
        else:
            unknown.append(i)
    ranked.sort(key=lambda pair: -pair[1][rank_task])  # stable: ties keep stage 1's order (rank_results.ranked)
    return ranked, unknown
