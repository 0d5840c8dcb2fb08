"""Input rows -> engine requests. A bad row becomes an error (field, reason), never an exception."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
from pydantic import BaseModel, ValidationError

from genrec.api import RecommendRequest, RetrieveRequest
from genrec.batch.shards import InputLayout

REQUEST_COLUMNS = ("prompt", "prompt_token_ids", "user_embedding", "exclude_item_ids")
# The recommend job's input: a prompt (text or token IDs), and optionally the rest.
RECOMMEND_INPUT = InputLayout(
    required=(("prompt", "prompt_token_ids"),), optional=("user_embedding", "exclude_item_ids", "candidates")
)


@dataclass
class RowError:
    position: int  # row in the shard
    field: str
    reason: str


@dataclass
class Parsed:
    requests: list = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # the shard row of each request
    errors: list[RowError] = field(default_factory=list)


def parse_rows(
    table: pa.Table,
    rank: bool,
    beam_width: int,
    num_results: int | None,
    embeddings: list | None = None,
    ranking: dict | None = None,
) -> Parsed:
    """Recommend's rows (retrieve's, or with `rank` recommend's requests). `embeddings` (from the cache) fill
    rows that carry none; `ranking`: recommend's rank_by and score_weight."""
    kind = RecommendRequest if rank else RetrieveRequest
    settings = {"beam_width": beam_width, "num_results": num_results}
    if rank:
        settings |= ranking or {}
    wanted = [*REQUEST_COLUMNS, "candidates"] if rank else list(REQUEST_COLUMNS)

    def complete(row: int, fields: dict) -> RowError | None:
        if embeddings is not None and "user_embedding" not in fields:
            if embeddings[row] is None:
                return RowError(row, "user_embedding", "none in the row and none in the cache")
            fields["user_embedding"] = embeddings[row]
        if "candidates" in fields:
            fields["candidates"] = [{"item_id": c} if isinstance(c, str) else c for c in fields["candidates"]]
        return None

    return validate_rows(table, kind, wanted, settings, complete)


def validate_rows(
    table: pa.Table,
    kind: type[BaseModel],
    wanted: list[str],
    settings: dict,
    complete: Callable[[int, dict], RowError | None] | None = None,
) -> Parsed:
    """Every row as a `kind` request (the API model validates it) made of its non-null `wanted` columns and the
    job's `settings`; `complete(row, fields)` may add to a row's fields or refuse the row. A null user_id, a
    refused row or a failed validation becomes a RowError naming the field."""
    columns = {name: table.column(name).to_pylist() for name in wanted if name in table.column_names}
    user_ids = table.column("user_id").to_pylist()
    parsed = Parsed()
    for row, user_id in enumerate(user_ids):
        if user_id is None:
            parsed.errors.append(RowError(row, "user_id", "is null"))
            continue
        fields = {name: values[row] for name, values in columns.items() if values[row] is not None}
        refused = complete(row, fields) if complete else None
        if refused is not None:
            parsed.errors.append(refused)
            continue
        try:
            request = kind(**fields, **settings)
        except ValidationError as err:
            parsed.errors.append(_validation_error(row, err, kind))
            continue
        parsed.requests.append(request)
        parsed.positions.append(row)
    return parsed


def _validation_error(row: int, err: ValidationError, kind) -> RowError:
    first = err.errors()[0]
    reason = first["msg"].removeprefix("Value error, ")
    name = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]).lstrip(".")
    if not name:  # a check across fields: its message quotes the field(s) it is about
        quoted = [f for f in re.findall(r"'(\w+)'", reason) if f in kind.model_fields]
        name = quoted[0] if quoted else "row"
    return RowError(row, name, reason)
