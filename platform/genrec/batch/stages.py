"""A batch job's stages (one; the funnel's two: `stages_of`). Each has its input columns (`layout`), its model and
its results folder, and does three things with a shard (the ShardWorker runs any of them):

    parse(rows)                      the rows as API requests; a bad row is a RowError naming its field
    infer(engine, requests)          one Engine.run: each request's result, or the exception it failed with
    table(rows, positions, results)  the results of shard rows `positions` as output rows

Any exception while parsing or running one row is that row's error, never more."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import pyarrow as pa
from pydantic import BaseModel, ValidationError

from genrec.api import RankRequest, RecommendRequest, RetrieveRequest, expected_value, located_error
from genrec.batch.output import RANKINGS, RECOMMENDATIONS
from genrec.batch.shards import InputLayout
from genrec.batch.spec import (
    Execution,
    FunnelStage,
    RankingExecution,
    RankStage,
    RecommendStage,
    StageSpec,
    ranking_config,
)
from genrec.batch.tables import (
    ROW,
    Degraded,
    RowError,
    Versions,
    described,
    funnel_table,
    rankings_table,
    recommendations_table,
    user_spans,
)
from genrec.batch.user_embeddings import lookup
from genrec.engine_options import DECODER_OPTIONS
from genrec.errors import GenrecError, InvalidRequestError
from genrec.model.directory import ModelDir


@dataclass
class Parsed:
    requests: list = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # the shard row of each request
    errors: list[RowError] = field(default_factory=list)


@dataclass
class Rows:
    """A shard's input rows, as a job sees them."""

    table: pa.Table  # the job's layout's columns
    versions: Versions  # of the model and the catalog the job's engine runs
    run_id: str
    handed: pa.Table | None = None  # a later stage's: the shard's results of the stage before (with ROW)

    @cached_property
    def user_ids(self) -> pa.Array:
        return self.table.column("user_id").combine_chunks()


class Stage:
    spec: StageSpec
    layout: InputLayout  # the input columns it reads
    results: str  # the output folder of its results
    model: str  # the model directory its engine runs

    def connect(self) -> None:
        """Once Ray is up, on the driver: what the job needs of it (e.g. an actor's client)."""

    def engine_kwargs(self) -> dict:
        """`Engine.from_pretrained`'s options for its model: the spec's."""
        return self.spec.engine_kwargs()


class Retrieve(Stage):
    """Constrained beam search for each user's prompt (and user embedding: the row's, or the cache's)."""

    layout = InputLayout(
        required=(("prompt", "messages", "prompt_token_ids"),),
        optional=("user_embedding", "exclude_item_ids", "filters", "allowed_item_ids"),
    )
    results = RECOMMENDATIONS
    kind, request = "retrieve", RetrieveRequest
    columns = [
        *("prompt", "messages", "prompt_token_ids", "user_embedding"),
        *("exclude_item_ids", "filters", "allowed_item_ids"),
    ]

    def __init__(self, spec: RecommendStage):
        self.spec, self.model, self.cache = spec, spec.model, None

    def connect(self) -> None:
        """Once Ray is up: the embedding cache's client, with `spec.cache`."""
        if self.spec.cache is None:
            return
        from genrec.cache.actor import EmbeddingCache  # it imports Ray

        directory = ModelDir.open(self.model)
        if directory.user_dim is None:
            raise GenrecError(f"{directory.path}: the model has no soft-token projector to take user embeddings")
        self.cache = EmbeddingCache.connect(self.spec.cache.with_dim(directory.user_dim))

    def settings(self) -> dict:
        spec = self.spec
        return {"beam_width": spec.beam_width, "beam_widths": spec.beam_widths, "num_results": spec.retrieved_codes}

    def parse(self, rows: Rows) -> Parsed:
        embeddings = None
        if self.cache is not None and "user_embedding" not in rows.table.column_names:
            embeddings = lookup(self.cache, rows.user_ids.to_pylist())

        def complete(row: int, fields: dict) -> RowError | None:
            if embeddings is not None and "user_embedding" not in fields:
                if embeddings[row] is None:
                    return RowError(row, "user_embedding", "none in the row and none in the cache")
                fields["user_embedding"] = embeddings[row]
            if "candidates" in fields:
                fields["candidates"] = [{"item_id": c} if isinstance(c, str) else c for c in fields["candidates"]]
            if "filters" in fields:
                return row_filters(row, fields)
            return None

        return validate_rows(rows.table, self.request, self.columns, self.settings(), complete)

    def infer(self, engine, requests: list) -> list:
        return engine.run(requests, self.kind)

    def table(self, rows: Rows, positions: list[int], results: list) -> pa.Table:
        scored = self.kind == "recommend"
        return recommendations_table(rows.user_ids, positions, results, scored, rows.versions, rows.run_id)


class Recommend(Retrieve):
    """Retrieve, then score the retrieved items and the given candidates with the label on the same prefill."""

    kind, request, columns = "recommend", RecommendRequest, [*Retrieve.columns, "candidates"]
    layout = InputLayout(Retrieve.layout.required, (*Retrieve.layout.optional, "candidates"))

    def settings(self) -> dict:
        return {**super().settings(), "rank_by": self.spec.order_by, "score_weight": self.spec.score_weight}


class BeamOrder(Recommend):
    """The funnel's stage 1, as online (genrec.funnel): the recommend in beam order, nothing scored."""

    def settings(self) -> dict:
        return {**Retrieve.settings(self), "rank_by": "beam"}


class Rank(Stage):
    """Each user's given candidates after the user's history, every task's probability (an HSTU model)."""

    layout = InputLayout(required=(("history",), ("candidates",)), optional=("tasks",))
    results = RANKINGS

    def __init__(self, spec: RankStage):
        self.spec, self.model, self.tasks = spec, spec.model, tuple(ranking_config(spec.model).tasks)

    def parse(self, rows: Rows) -> Parsed:
        """With rank_by, a row whose tasks leave that task out is refused (its candidates could not be ranked)."""
        rank_by = self.spec.rank_by

        def complete(row: int, fields: dict) -> RowError | None:
            tasks = fields.get("tasks")
            if rank_by is not None and isinstance(tasks, list) and rank_by not in tasks:
                return RowError(row, "tasks", f"leaves out {rank_by!r}, the task the candidates are ranked by")
            return None

        return validate_rows(rows.table, RankRequest, ["history", "candidates", "tasks"], {}, complete)

    def infer(self, engine, requests: list) -> list:
        return engine.run(requests, "rank")

    def table(self, rows: Rows, positions: list[int], results: list) -> pa.Table:
        return rankings_table(
            rows.user_ids, positions, results, self.tasks, self.spec.rank_by, rows.versions, rows.run_id
        )


class RankRetrieved(Stage):
    """The funnel's stage 2 (docs/batch.md, "The funnel, nightly: `--ranker`"): a refused history is an error row;
    any other failure of the ranker degrades the user (tables.Degraded)."""

    layout = InputLayout(required=(("history",),))
    results = RECOMMENDATIONS

    def __init__(self, spec: FunnelStage):
        self.spec, self.model, self.tasks = spec, spec.ranker, tuple(ranking_config(spec.ranker).tasks)

    def engine_kwargs(self) -> dict:
        """The spec's, less the decoder's own options (`fp8`, `split_kv`, `attention`): the funnel's are its
        retriever's, and an HSTU ranker has no such paths."""
        return {name: value for name, value in self.spec.engine_kwargs().items() if name not in DECODER_OPTIONS}

    def parse(self, rows: Rows) -> Parsed:
        """A RankRequest per user stage 1 has items for: the user's history and those items."""
        if rows.handed is None:
            raise GenrecError("stage 1 found this shard committed, and it is not: was the output changed?")
        spans = user_spans(rows.handed.column(ROW).to_numpy())
        item_ids = rows.handed.column("item_id").to_pylist()
        positions = [position for position, _, _ in spans]
        candidates = [[i for i in item_ids[lo:hi] if i is not None] for _, lo, hi in spans]
        take = pa.array(positions, pa.int64())
        asked = pa.table(
            {
                "user_id": rows.user_ids.take(take),
                "history": rows.table.column("history").combine_chunks().take(take),
                "candidates": pa.array(candidates, pa.list_(pa.string())),
            }
        )
        parsed = validate_rows(asked, RankRequest, ["history", "candidates"], {"unknown_candidates": "skip"})
        parsed.positions = [positions[k] for k in parsed.positions]
        for error in parsed.errors:
            error.position = positions[error.position]
        return parsed

    def infer(self, engine, requests: list) -> list:
        """Every user's items ranked in one run; a failure other than a refusal of the request is Degraded."""
        return [_degraded(outcome) for outcome in engine.run(requests, "rank")]

    def table(self, rows: Rows, positions: list[int], results: list) -> pa.Table:
        by_row = dict(zip(positions, results, strict=True))
        spec = self.spec
        return funnel_table(rows.handed, by_row, self.tasks, spec.rank_task, rows.versions.model, spec.num_results)


def stages_of(spec: StageSpec, execution: Execution, ranking: RankingExecution) -> list[tuple[Stage, Execution]]:
    """The spec's stages as (stage, how it runs), in order: one stage, or the funnel's two."""
    if isinstance(spec, RankStage):
        return [(Rank(spec), execution)]
    if isinstance(spec, FunnelStage):
        first = (Recommend if spec.score else BeamOrder)(spec)
        return [(first, execution), (RankRetrieved(spec), ranking.over(execution))]
    return [((Recommend if spec.score else Retrieve)(spec), execution)]


def _degraded(outcome):
    """A ranker's outcome for one funnel user: a failure that is not a refusal of the user's input is Degraded."""
    if isinstance(outcome, Exception) and not isinstance(outcome, InvalidRequestError):
        return Degraded(f"ranker_error: {described(outcome)}")  # the online funnel's reason, with what failed
    return outcome


def row_filters(row: int, fields: dict) -> RowError | None:
    """A row's `filters`: a JSON object (a string column) or a struct column's value (its null fields left out)."""
    value = fields["filters"]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            return RowError(row, "filters", f"is not valid JSON ({err})")
        if not isinstance(value, dict):
            return RowError(row, "filters", "must be a JSON object: {attribute: condition}")
    elif isinstance(value, dict):
        value = {name: condition for name, condition in value.items() if condition is not None}
    fields["filters"] = value
    return None


def validate_rows(
    table: pa.Table,
    kind: type[BaseModel],
    wanted: list[str],
    settings: dict,
    complete: Callable[[int, dict], RowError | None] | None = None,
) -> Parsed:
    """Every row as a `kind` request of its non-null `wanted` columns and the job's `settings`; `complete(row,
    fields)` may add fields or refuse the row. A refusal is a RowError naming the field; any other exception one
    row's data causes, a RowError of the request."""
    columns = {name: table.column(name).to_pylist() for name in wanted if name in table.column_names}
    parsed = Parsed()
    for row, user_id in enumerate(table.column("user_id").to_pylist()):
        if user_id is None:
            parsed.errors.append(RowError(row, "user_id", "is null"))
            continue
        fields = {name: values[row] for name, values in columns.items() if values[row] is not None}
        try:
            refused = complete(row, fields) if complete else None
            if refused is None:
                request = kind(**fields, **settings)
        except ValidationError as err:
            refused = _validation_error(row, err, kind, nulls=columns.keys() - fields.keys())
        except Exception as err:  # noqa: BLE001 - one row's data: that row's error, never the job's
            refused = RowError.of(row, err)
        if refused is not None:
            parsed.errors.append(refused)
            continue
        parsed.requests.append(request)
        parsed.positions.append(row)
    return parsed


def _validation_error(row: int, err: ValidationError, kind, nulls) -> RowError:
    """The row's first error in genrec's words (api.located_error); `nulls`: the row's null columns (left out of the
    request, so that a null reads as not given): a required one is refused as such."""
    first = err.errors()[0]
    name, reason = located_error(first, kind)
    if first.get("type") == "missing" and name in nulls:
        expected = expected_value(kind, name)
        reason = f"is required ({expected}); got null" if expected else "is required; got null"
    if not name:  # a check across fields: its message quotes the field(s) it is about
        quoted = [f for f in re.findall(r"'(\w+)'", reason) if f in kind.model_fields]
        name = quoted[0] if quoted else "row"
    return RowError(row, name, reason)
