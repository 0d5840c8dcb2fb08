"""Engine results and row errors -> the output tables: one row per (user, rank), one row per bad input row."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from genrec.batch.rows import RowError


def output_schema(user_id: pa.DataType) -> pa.Schema:
    return pa.schema(
        [
            ("user_id", user_id),
            ("rank", pa.int32()),  # 1 = best
            ("item_id", pa.string()),
            ("semantic_id", pa.list_(pa.int64())),
            ("retrieval_logprob", pa.float64()),  # null for a given candidate (recommend)
            ("code_logprob", pa.float64()),  # log P(item | prompt); null for a given one unless rank_by is joint
            ("score", pa.float64()),  # recommend: the label logprob; retrieve: null
            ("model_version", pa.string()),
            ("run_id", pa.string()),
        ]
    )


def error_schema(user_id: pa.DataType) -> pa.Schema:
    return pa.schema(
        [
            ("user_id", user_id),
            ("row", pa.int64()),  # in its input file
            ("field", pa.string()),
            ("reason", pa.string()),
            ("run_id", pa.string()),
        ]
    )


def recommendations_table(
    user_ids: pa.Array, positions: list[int], results: list, rank: bool, model_version: str, run_id: str
) -> pa.Table:
    """`results`: RetrieveResults (items ranked by beam logprob) or, with `rank`, RecommendResults (ranked by
    their request's rank_by: score, or code_logprob + score)."""
    items = [item for r in results for item in r.items]
    users, ranks = per_user_rows(user_ids, positions, [len(r.items) for r in results])
    columns = {
        "user_id": users,
        "rank": ranks,
        "item_id": [item.item_id for item in items],
        "semantic_id": [item.semantic_id for item in items],
        "retrieval_logprob": [item.retrieval_logprob if rank else item.logprob for item in items],
        "code_logprob": [item.code_logprob if rank else item.logprob for item in items],
        "score": [item.score_logprob if rank else None for item in items],
        "model_version": [model_version] * len(items),
        "run_id": [run_id] * len(items),
    }
    return pa.table(columns, schema=output_schema(user_ids.type))


def per_user_rows(user_ids: pa.Array, positions: list[int], counts: list[int]) -> tuple[pa.Array, pa.Array]:
    """For output rows that list each user's items, `counts[k]` of them for the user in shard row
    `positions[k]`, best first: each row's user_id and its rank (1 = best)."""
    counts = np.asarray(counts, dtype=np.int64)
    first_of_user = np.repeat(np.cumsum(counts) - counts, counts)
    users = user_ids.take(pa.array(np.repeat(np.asarray(positions, dtype=np.int64), counts)))
    return users, pa.array(np.arange(int(counts.sum())) - first_of_user + 1, pa.int32())


def errors_table(user_ids: pa.Array, errors: list[RowError], first_row: int, run_id: str) -> pa.Table:
    columns = {
        "user_id": user_ids.take(pa.array([e.position for e in errors], pa.int64())),
        "row": [first_row + e.position for e in errors],
        "field": [e.field for e in errors],
        "reason": [e.reason for e in errors],
        "run_id": [run_id] * len(errors),
    }
    return pa.table(columns, schema=error_schema(user_ids.type))
