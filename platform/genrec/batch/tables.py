"""The output tables (their columns: docs/batch.md): one row per bad input row (errors/), and one per (user, item)
of each job, each user's rows together, best first (rank 1)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from genrec.api import RankResult
from genrec.errors import GenrecError, InvalidRequestError
from genrec.funnel import final_order

TASK_PREFIX = "prob_"
ROW = "shard_row"  # in a stage's handed-on table: the shard row of each item's user (not in the output)


@dataclass
class RowError:
    position: int  # row in the shard
    field: str
    reason: str

    @classmethod
    def of(cls, position: int, failure: Exception) -> RowError:
        """The row error of a request that failed: the field the model refused, else the request as a whole."""
        if isinstance(failure, InvalidRequestError):
            return cls(position, failure.field, failure.problem)
        return cls(position, "request", described(failure))


@dataclass(frozen=True)
class Versions:
    """What produced a job's rows: the model (weights, tokenizer) and the catalog it served, each a content hash."""

    model: str
    catalog: str

    def as_columns(self) -> dict[str, str]:
        return {"model_version": self.model, "catalog_version": self.catalog}


@dataclass(frozen=True)
class Degraded:
    """A funnel user the ranker failed for (not one it refused): stage 1's items kept, in beam order."""

    reason: str


def described(failure: Exception) -> str:
    """A GenrecError's own message; any other exception (a bug one row's data hit) as an internal error."""
    if isinstance(failure, GenrecError):
        return str(failure)
    return f"internal error ({type(failure).__name__}: {failure})"


def errors_table(user_ids: pa.Array, errors: list[RowError], first_row: int, run_id: str) -> pa.Table:
    columns = {
        "user_id": user_ids.take(pa.array([e.position for e in errors], pa.int64())),
        "row": pa.array([first_row + e.position for e in errors], pa.int64()),  # in its input file
        "field": pa.array([e.field for e in errors], pa.string()),
        "reason": pa.array([e.reason for e in errors], pa.string()),
        "run_id": pa.array([run_id] * len(errors), pa.string()),
    }
    return pa.table(columns)


def recommendations_table(
    user_ids: pa.Array, positions: list[int], results: list, scored: bool, versions: Versions, run_id: str
) -> pa.Table:
    """`results`: RetrieveResults or, `scored`, RecommendResults (in their order). retrieval_logprob is null for a
    given candidate, code_logprob too unless ordered by joint; score is null unless `scored`."""
    items = [item for r in results for item in r.items]
    columns = {
        "item_id": pa.array([item.item_id for item in items], pa.string()),
        "semantic_id": pa.array([item.semantic_id for item in items], pa.list_(pa.int64())),
        "retrieval_logprob": _floats(item.retrieval_logprob if scored else item.logprob for item in items),
        "code_logprob": _floats(item.code_logprob if scored else item.logprob for item in items),
        "score": _floats(item.score_logprob if scored else None for item in items),
    }
    return _per_user(user_ids, positions, [len(r.items) for r in results], columns, versions, run_id)


def rankings_table(
    user_ids: pa.Array,
    positions: list[int],
    results: list[RankResult],
    tasks: tuple[str, ...],
    rank_by: str | None,
    versions: Versions,
    run_id: str,
) -> pa.Table:
    """`results`: the RankResults of shard rows `positions`; `tasks`: the model's. Each user's items by rank_by's
    probability (ties, or no rank_by: the candidates' order); a task the row's `tasks` left out is null."""
    ranked = [r.items if rank_by is None else sorted(r.items, key=lambda i: -i.scores[rank_by]) for r in results]
    items = [item for user in ranked for item in user]
    columns = {
        "item_id": pa.array([item.item_id for item in items], pa.string()),
        **{TASK_PREFIX + task: _floats(item.scores.get(task) for item in items) for task in tasks},
    }
    return _per_user(user_ids, positions, [len(r) for r in ranked], columns, versions, run_id)


def funnel_table(
    retrieved: pa.Table,
    results: dict[int, RankResult | Degraded],
    tasks: tuple[str, ...],
    rank_task: str,
    version: str,
    num_results: int | None = None,
) -> pa.Table:
    """`retrieved`: stage 1's rows (with ROW), each user's together in stage 1's order. `results`: shard row ->
    the RankResult of the items the ranker knows, or Degraded; users absent from it (refused) are left out.
    Ordered by genrec.funnel.final_order; each user's first `num_results` kept (None: all)."""
    item_ids = retrieved.column("item_id").to_pylist()
    order, scores, counts, reasons = [], [], [], []
    for position, lo, hi in user_spans(retrieved.column(ROW).to_numpy()):
        if position not in results:
            continue
        result = results[position]
        ranked = {item.item_id: item.scores for item in result.items} if isinstance(result, RankResult) else {}
        kept = final_order(item_ids[lo:hi], ranked, rank_task)[:num_results]
        for k in kept:
            order.append(lo + k)
            scores.append(ranked.get(item_ids[lo + k]))
        counts.append(len(kept))
        reasons += [result.reason if isinstance(result, Degraded) else None] * len(kept)
    kept = retrieved.take(pa.array(order, pa.int64()))
    columns = {"user_id": kept["user_id"], "rank": _ranks(counts), "retrieval_rank": kept["rank"]}
    columns |= {name: kept[name] for name in ("item_id", "semantic_id", "retrieval_logprob", "code_logprob", "score")}
    columns |= {TASK_PREFIX + t: _floats(None if s is None else s[t] for s in scores) for t in tasks}
    columns |= {
        "degraded": pa.array([r is not None for r in reasons], pa.bool_()),
        "degraded_reason": pa.array(reasons, pa.string()),
    }
    columns |= {name: kept[name] for name in ("model_version", "catalog_version")}
    columns |= {"ranker_version": pa.array([version] * len(order), pa.string())}
    return pa.table(columns | {"run_id": kept["run_id"]})


def degraded_users(results: pa.Table) -> int:
    """Users of a funnel table whose stage 1 order was kept because the ranker failed (0 for the other jobs)."""
    if "degraded" not in results.column_names:
        return 0
    return int(pc.sum(pc.and_(results["degraded"], pc.equal(results["rank"], 1))).as_py() or 0)


def user_spans(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """(shard row, first, end) of each user's run of a handed-on table's rows."""
    if not len(rows):
        return []
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
    ends = np.r_[starts[1:], len(rows)]
    return [(int(rows[s]), int(s), int(e)) for s, e in zip(starts, ends, strict=True)]


def _per_user(user_ids, positions, counts, columns, versions: Versions, run_id) -> pa.Table:
    """Each user's items best first, `counts[k]` of them for the user of shard row `positions[k]`."""
    rows = int(sum(counts))
    users = user_ids.take(pa.array(np.repeat(np.asarray(positions, np.int64), counts), pa.int64()))
    named = {name: pa.array([value] * rows, pa.string()) for name, value in versions.as_columns().items()}
    run = pa.array([run_id] * rows, pa.string())
    return pa.table({"user_id": users, "rank": _ranks(counts), **columns, **named, "run_id": run})


def _ranks(counts: list[int]) -> pa.Array:
    """1, 2, ... within each user's run of `counts[k]` rows."""
    counts = np.asarray(counts, np.int64)
    first_of_user = np.repeat(np.cumsum(counts) - counts, counts)
    return pa.array(np.arange(int(counts.sum())) - first_of_user + 1, pa.int32())


def _floats(values) -> pa.Array:
    return pa.array(list(values), pa.float64())
