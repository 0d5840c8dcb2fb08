"""A request's filters compiled against the catalog's item attributes: a bool mask [N] of the items it allows.

Forms, semantics and refusals: docs/engine.md, 'Filters' (the models: genrec.api.Filtered). Vectorised with
pyarrow.compute over whole columns: a 1 M-item catalog compiles in milliseconds.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from genrec.api import FilterRange
from genrec.catalog.catalog import Catalog
from genrec.errors import InvalidRequestError

AVAILABLE_AT = "available_at"  # the filters' one reserved key: the availability window
WINDOW = ("available_from", "available_until")
RANGE_OPS = {"gte": pc.greater_equal, "gt": pc.greater, "lte": pc.less_equal, "lt": pc.less}


@dataclass
class Column:
    """An attribute column ready to test (a list column flattened, `parents` each value's item). Text is also kept
    dictionary-encoded: a test checks the few distinct values, then gathers (1 M items ~2 ms, vs ~15 ms per string)."""

    values: pa.Array
    parents: np.ndarray | None  # list column: [values] the item row of each value
    items: int
    dictionary: pa.Array | None = None  # text: the distinct values
    codes: np.ndarray | None = None  # text: [values] each value's index in `dictionary`, -1 for null

    @classmethod
    def of(cls, column: pa.ChunkedArray, items: int) -> Column:
        array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        parents = None
        kind = array.type
        if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
            parents = pc.list_parent_indices(array).to_numpy()
            array = pc.list_flatten(array)
        if pa.types.is_dictionary(array.type):
            array = array.dictionary_decode()
        if not (pa.types.is_string(array.type) or pa.types.is_large_string(array.type)):
            return cls(array, parents, items)
        encoded = pc.dictionary_encode(array)
        codes = pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)
        return cls(array, parents, items, encoded.dictionary, codes)

    @property
    def kind(self) -> pa.DataType:
        return self.values.type

    @cached_property
    def distinct(self) -> set:
        """Text: the values some item has (what unknown values are checked against)."""
        return set(self.dictionary.to_pylist())

    def text_hits(self, wanted: list[str]) -> np.ndarray:
        """[items] bool: the items with one of these text values (a list column: among its values)."""
        hit = np.append(
            pc.is_in(self.dictionary, value_set=pa.array(wanted, self.kind)).to_numpy(zero_copy_only=False), False
        )
        return self.per_item(hit[self.codes])  # a null's code -1 reads the False appended

    def per_item(self, hits: pa.Array | np.ndarray) -> np.ndarray:
        """[items] bool from a test of every value: a list column's item is hit when any of its values is."""
        hit = hits if isinstance(hits, np.ndarray) else pc.fill_null(hits, False).to_numpy(zero_copy_only=False)
        if self.parents is None:
            return hit
        out = np.zeros(self.items, dtype=bool)
        out[self.parents[hit]] = True
        return out


class Attributes:
    """A catalog's attribute columns, each prepared once on first use (per catalog version; thread-safe)."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        table = catalog.attributes
        self.names = table.column_names if table is not None else []
        self._columns: dict[str, Column] = {}
        self._lock = threading.Lock()

    def column(self, name: str, field: str) -> Column:
        if name not in self.names:
            have = ", ".join(self.names) if self.names else "none"
            raise InvalidRequestError(field, f"no item attribute {name!r} in this catalog (its attributes: {have})")
        with self._lock:
            found = self._columns.get(name)
        if found is None:
            found = Column.of(self.catalog.attributes.column(name), len(self.catalog))
            with self._lock:
                self._columns[name] = found
        return found


def allowed_items(attributes: Attributes, filters: dict | None, allowed_item_ids: list[str] | None) -> np.ndarray:
    """[N] bool: the items the request's filters and allow list both allow."""
    catalog = attributes.catalog
    mask = np.ones(len(catalog), dtype=bool) if allowed_item_ids is None else _listed(catalog, allowed_item_ids)
    for name, condition in (filters or {}).items():
        field = f"filters.{name}"
        if name == AVAILABLE_AT:
            mask &= _available(attributes, condition, field)
        else:
            mask &= _condition(attributes.column(name, field), condition, name, field)
    return mask


def _listed(catalog: Catalog, item_ids: list[str]) -> np.ndarray:
    mask = np.zeros(len(catalog), dtype=bool)
    index = [catalog.index_of(i) for i in item_ids]
    if None in index:
        k = index.index(None)
        raise InvalidRequestError(f"allowed_item_ids[{k}]", f"item {item_ids[k]!r} is not in the catalog")
    mask[np.asarray(index, dtype=np.int64)] = True
    return mask


def _condition(column: Column, condition, name: str, field: str) -> np.ndarray:
    """The items one attribute's condition allows. A value Arrow cannot hold in the column's type (beyond int64, an
    integer column's bound that overflows it) is the client's mistake, named as such."""
    try:
        return _hits(column, condition, name, field)
    except (pa.ArrowException, TypeError, OverflowError) as err:
        raise InvalidRequestError(field, f"does not fit attribute {name!r} ({column.kind}): {err}") from None


def _hits(column: Column, condition, name: str, field: str) -> np.ndarray:
    if isinstance(condition, FilterRange):
        hits = None
        for op, bound in condition.model_dump(exclude_none=True).items():
            test = RANGE_OPS[op](column.values, _range_bound(column, bound, name, f"{field}.{op}"))
            hits = test if hits is None else pc.and_kleene(hits, test)
        return column.per_item(hits)
    if isinstance(condition, list):
        wanted = [_value(column, v, name, f"{field}[{k}]") for k, v in enumerate(condition)]
    else:
        wanted = [_value(column, condition, name, field)]
    if column.dictionary is not None:
        return column.text_hits(wanted)
    return column.per_item(pc.is_in(column.values, value_set=pa.array(wanted, column.kind)))


def _value(column: Column, value, name: str, field: str):
    """An equality value as the column's type; text must be a value some item has."""
    kind = column.kind
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        if not isinstance(value, str):
            raise InvalidRequestError(field, f"attribute {name!r} holds text, not {type(value).__name__}")
        if value not in column.distinct:
            raise InvalidRequestError(field, f"{value!r} is not a value of attribute {name!r} (no item has it)")
        return value
    if pa.types.is_boolean(kind):
        if not isinstance(value, bool):
            raise InvalidRequestError(field, f"attribute {name!r} holds true/false, not {type(value).__name__}")
        return value
    value = _range_bound(column, value, name, field)
    if pa.types.is_integer(kind) and isinstance(value, float):
        if not value.is_integer():  # Arrow would truncate it: 1991.5 would match 1991
            raise InvalidRequestError(field, f"attribute {name!r} holds integers, not {value!r}")
        value = int(value)
    return value


def _range_bound(column: Column, value, name: str, field: str):
    """A number for a numeric column, an ISO-8601 time for a timestamp column, as a scalar of its type."""
    kind = column.kind
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequestError(field, f"attribute {name!r} holds numbers, not {type(value).__name__}")
        if isinstance(value, int) and not -(2**63) <= value < 2**63:
            return float(value)  # beyond int64: compared as a float (a bound no integer column reaches)
        return value
    if pa.types.is_timestamp(kind):
        return _time(value, kind, field)
    raise InvalidRequestError(field, f"attribute {name!r} ({kind}) takes equality or membership only, not a range")


def _time(value, kind: pa.TimestampType, field: str) -> pa.Scalar:
    """An ISO-8601 string as a scalar of a timestamp column's type (a time without a zone is UTC; a column
    without one is read as UTC)."""
    if not isinstance(value, str):
        raise InvalidRequestError(field, f"a time is an ISO-8601 string (e.g. 2026-12-01T00:00:00Z), not {value!r}")
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise InvalidRequestError(field, f"{value!r} is not an ISO-8601 time (e.g. 2026-12-01T00:00:00Z)") from None
    when = when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)
    if kind.tz is None:
        when = when.replace(tzinfo=None)
    # Microseconds, then the column's unit (truncating to a coarser one, as a bound on such a column does).
    return pc.cast(pa.scalar(when, pa.timestamp("us", kind.tz)), kind, safe=False)


def _available(attributes: Attributes, value, field: str) -> np.ndarray:
    """available_from <= t < available_until, a null bound open."""
    missing = [c for c in WINDOW if c not in attributes.names]
    if missing:
        raise InvalidRequestError(field, f"needs the catalog attributes {' and '.join(WINDOW)} (missing: {missing})")
    start, until = (attributes.column(c, field) for c in WINDOW)
    for name, column in zip(WINDOW, (start, until), strict=True):
        if not pa.types.is_timestamp(column.kind) or column.parents is not None:
            raise InvalidRequestError(field, f"attribute {name!r} must be a timestamp column, not {column.kind}")
    opened = pc.fill_null(pc.less_equal(start.values, _time(value, start.kind, field)), True)
    closed = pc.fill_null(pc.less(_time(value, until.kind, field), until.values), True)
    return pc.and_(opened, closed).to_numpy(zero_copy_only=False)
