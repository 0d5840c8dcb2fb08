"""Rank results -> the rank job's output table: one row per (user, candidate), each task's probability in a
column of its own (`prob_<task>`, null for a task the row's `tasks` left out)."""

from __future__ import annotations

import pyarrow as pa

from genrec.api import RankResult
from genrec.batch.results import per_user_rows

TASK_PREFIX = "prob_"


def rankings_schema(user_id: pa.DataType, tasks: tuple[str, ...]) -> pa.Schema:
    return pa.schema(
        [
            ("user_id", user_id),
            ("rank", pa.int32()),  # 1 = best by the rank_by task; without one, the candidate's place in the list
            ("item_id", pa.string()),
            *((TASK_PREFIX + task, pa.float64()) for task in tasks),
            ("model_version", pa.string()),
            ("run_id", pa.string()),
        ]
    )


def ranked(result: RankResult, rank_by: str | None) -> list:
    """The result's items best first: by the rank_by task's probability, highest first, ties in the candidates'
    order (a stable sort); without rank_by, in the candidates' order."""
    if rank_by is None:
        return list(result.items)
    return sorted(result.items, key=lambda item: -item.scores[rank_by])


def rankings_table(
    user_ids: pa.Array,
    positions: list[int],
    results: list[RankResult],
    tasks: tuple[str, ...],
    rank_by: str | None,
    model_version: str,
    run_id: str,
) -> pa.Table:
    """`results`: the RankResults of the requests of shard rows `positions`; `tasks`: the model's."""
    items = [item for result in results for item in ranked(result, rank_by)]
    users, ranks = per_user_rows(user_ids, positions, [len(r.items) for r in results])
    columns = {
        "user_id": users,
        "rank": ranks,
        "item_id": [item.item_id for item in items],
        **{TASK_PREFIX + task: [item.scores.get(task) for item in items] for task in tasks},
        "model_version": [model_version] * len(items),
        "run_id": [run_id] * len(items),
    }
    return pa.table(columns, schema=rankings_schema(user_ids.type, tasks))
