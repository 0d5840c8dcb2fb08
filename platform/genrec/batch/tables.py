"""The output tables: one row per bad input row (errors/), and one per (user, item) of each job:

    recommend  user_id, rank, item_id, semantic_id, retrieval_logprob, code_logprob, score, model_version, run_id
    rank       user_id, rank, item_id, prob_<task>..., model_version, run_id
    funnel     recommend's, with retrieval_rank after rank, prob_<task>... before model_version, ranker_version after

Each user's rows are together, best first (rank 1)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from genrec.api import RankResult
from genrec.funnel import final_order

TASK_PREFIX = "prob_"
ROW = "shard_row"  # in a stage's handed-on table: the shard row of each item's user (not in the output)


@dataclass
class RowError:
    position: int  # row in the shard
    field: str
    reason: str


def errors_table(user_ids: pa.Array, errors: list[RowError], first_row: int, run_id: str) -> pa.Table:
    columns = {
        "user_id": user_ids.take(pa.array([e.position for e in errors], pa.int64())),
        "row": pa.array([first_row + e.position for e in errors], pa.int64()),  # in its input file
        "field": pa.array([e.field for e in errors], pa.string()),
        "reason": pa.array([e.reason for e in errors], pa.string()),
        "run_id": pa.array([run_id] * len(errors), pa.string()),
    }
    return pa.table(columns)


def recommendations_schema(user_id: pa.DataType) -> pa.Schema:
    return pa.schema(
        [
            ("user_id", user_id),
            ("rank", pa.int32()),  # 1 = best
            ("item_id", pa.string()),
            ("semantic_id", pa.list_(pa.int64())),
            ("retrieval_logprob", pa.float64()),  # null for a given candidate (recommend)
            ("code_logprob", pa.float64()),  # log P(item | prompt); null for a given one unless ordered by joint
            ("score", pa.float64()),  # recommend: the label logprob; retrieve: null
            ("model_version", pa.string()),
            ("run_id", pa.string()),
        ]
    )


def recommendations_table(
    user_ids: pa.Array, positions: list[int], results: list, scored: bool, model_version: str, run_id: str
) -> pa.Table:
    """`results`: RetrieveResults (items ranked by beam logprob) or, `scored`, RecommendResults (in their order)."""
    items = [item for r in results for item in r.items]
    columns = {
        "item_id": [item.item_id for item in items],
        "semantic_id": [item.semantic_id for item in items],
        "retrieval_logprob": [item.retrieval_logprob if scored else item.logprob for item in items],
        "code_logprob": [item.code_logprob if scored else item.logprob for item in items],
        "score": [item.score_logprob if scored else None for item in items],
    }
    counts = [len(r.items) for r in results]
    return _per_user(user_ids, positions, counts, columns, model_version, run_id, recommendations_schema(user_ids.type))


def rankings_table(
    user_ids: pa.Array,
    positions: list[int],
    results: list[RankResult],
    tasks: tuple[str, ...],
    rank_by: str | None,
    model_version: str,
    run_id: str,
) -> pa.Table:
    """`results`: the RankResults of the requests of shard rows `positions`; `tasks`: the model's. Each user's
    items by the rank_by task's probability, highest first, ties in the candidates' order; without rank_by, in the
    candidates' order. A task the row's `tasks` left out is null."""
    ranked = [r.items if rank_by is None else sorted(r.items, key=lambda i: -i.scores[rank_by]) for r in results]
    items = [item for user in ranked for item in user]
    columns = {
        "item_id": [item.item_id for item in items],
        **{TASK_PREFIX + task: [item.scores.get(task) for item in items] for task in tasks},
    }
    schema = pa.schema(
        [
            ("user_id", user_ids.type),
            ("rank", pa.int32()),  # 1 = best by the rank_by task; without one, the candidate's place in the list
            ("item_id", pa.string()),
            *((TASK_PREFIX + task, pa.float64()) for task in tasks),
            ("model_version", pa.string()),
            ("run_id", pa.string()),
        ]
    )
    return _per_user(user_ids, positions, [len(r) for r in ranked], columns, model_version, run_id, schema)


def funnel_table(
    retrieved: pa.Table, results: dict[int, RankResult | None], tasks: tuple[str, ...], rank_task: str, version: str
) -> pa.Table:
    """`retrieved`: stage 1's rows (with ROW), each user's together in stage 1's order. `results`: shard row ->
    the RankResult of that user's items the ranker knows (None: it knows none); the users left out (refused by the
    ranker) are left out. The final order and the unknown items' place: genrec.funnel.final_order."""
    item_ids = retrieved.column("item_id").to_pylist()
    order, scores, counts = [], [], []
    for position, lo, hi in user_spans(retrieved.column(ROW).to_numpy()):
        if position not in results:
            continue
        ranked = {item.item_id: item.scores for item in results[position].items} if results[position] else {}
        for k in final_order(item_ids[lo:hi], ranked, rank_task):
            order.append(lo + k)
            scores.append(ranked.get(item_ids[lo + k]))
        counts.append(hi - lo)
    table = retrieved.take(pa.array(order, pa.int64()))
    columns = {
        **{name: table.column(name) for name in table.column_names if name != ROW},
        "rank": _ranks(counts),
        "retrieval_rank": table.column("rank"),
        **{TASK_PREFIX + t: pa.array([None if s is None else s[t] for s in scores], pa.float64()) for t in tasks},
        "ranker_version": pa.array([version] * len(order), pa.string()),
    }
    after = {"rank": [("retrieval_rank", pa.int32())], "model_version": [("ranker_version", pa.string())]}
    fields = []
    for field in recommendations_schema(retrieved.schema.field("user_id").type):
        if field.name == "model_version":  # null: an item the ranker does not know
            fields += [(TASK_PREFIX + t, pa.float64()) for t in tasks]
        fields += [field, *after.get(field.name, [])]
    schema = pa.schema(fields)
    return pa.table([columns[name] for name in schema.names], schema=schema)


def user_spans(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """(shard row, first, end) of each user's run of a handed-on table's rows."""
    if not len(rows):
        return []
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
    ends = np.r_[starts[1:], len(rows)]
    return [(int(rows[s]), int(s), int(e)) for s, e in zip(starts, ends, strict=True)]


def _per_user(user_ids, positions, counts, columns, model_version, run_id, schema) -> pa.Table:
    """Rows that list each user's items best first, `counts[k]` of them for the user of shard row `positions[k]`."""
    rows = int(sum(counts))
    users = user_ids.take(pa.array(np.repeat(np.asarray(positions, np.int64), counts)))
    stamps = {"model_version": [model_version] * rows, "run_id": [run_id] * rows}
    return pa.table({"user_id": users, "rank": _ranks(counts), **columns, **stamps}, schema=schema)


def _ranks(counts: list[int]) -> pa.Array:
    """1, 2, ... within each user's run of `counts[k]` rows."""
    counts = np.asarray(counts, np.int64)
    first_of_user = np.repeat(np.cumsum(counts) - counts, counts)
    return pa.array(np.arange(int(counts.sum())) - first_of_user + 1, pa.int32())
