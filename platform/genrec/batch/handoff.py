"""What a stage hands the next one: one row per shard, the shard's descriptor and its results so far.

The tables travel as Arrow IPC bytes: one row stays one shard whatever Ray Data does with blocks, and the
tables keep their exact schema (user_id's type among it). No tables: the stage found the shard committed.
"""

from __future__ import annotations

import pyarrow as pa

from genrec.batch.shards import SHARD_SCHEMA, Shard

HANDOFF = pa.schema([*SHARD_SCHEMA, ("results", pa.large_binary()), ("errors", pa.large_binary())])


def handoff_row(shard: Shard, results: pa.Table | None = None, errors: pa.Table | None = None) -> dict:
    return {**shard.as_row(), "results": _to_bytes(results), "errors": _to_bytes(errors)}


def from_handoff(row: dict) -> tuple[Shard, pa.Table | None, pa.Table | None]:
    shard = Shard.from_row({name: row[name] for name in SHARD_SCHEMA.names})
    return shard, _from_bytes(row["results"]), _from_bytes(row["errors"])


def _to_bytes(table: pa.Table | None) -> bytes | None:
    if table is None:
        return None
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _from_bytes(data: bytes | None) -> pa.Table | None:
    return None if data is None else pa.ipc.open_stream(data).read_all()
