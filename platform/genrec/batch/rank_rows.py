"""The rank job's input rows -> RankRequests. A bad row becomes an error (field, reason), never an exception.

Columns:

    user_id     integers or strings
    history     list<struct<item_id: string, action: int (nullable), timestamp: float or int (nullable)>>,
                the user's events, oldest first (a struct may leave out action and timestamp)
    candidates  list<string>: the item IDs to rank
    tasks       optional list<string>: the model's tasks to score for that user (null: all)
"""

from __future__ import annotations

import pyarrow as pa

from genrec.api import RankRequest
from genrec.batch.rows import Parsed, RowError, validate_rows
from genrec.batch.shards import InputLayout

RANK_INPUT = InputLayout(required=(("history",), ("candidates",)), optional=("tasks",))


def parse_rank_rows(table: pa.Table, rank_by: str | None) -> Parsed:
    """Every row as a RankRequest; with `rank_by`, a row whose tasks leave that task out is refused (its
    candidates could not be ranked)."""

    def complete(row: int, fields: dict) -> RowError | None:
        tasks = fields.get("tasks")
        if rank_by is not None and isinstance(tasks, list) and rank_by not in tasks:
            return RowError(row, "tasks", f"leaves out {rank_by!r}, the task the candidates are ranked by")
        return None

    return validate_rows(table, RankRequest, ["history", "candidates", "tasks"], {}, complete)
