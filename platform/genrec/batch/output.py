"""The output directory of a run:

    OUT/manifest.json                      the run's identity (args, model version, input fingerprint, run_id)
    OUT/recommendations/part-NNNNNN.parquet one file per input shard: the commit point of that shard (the
                                           results folder: `recommendations/`, or the rank job's `rankings/`)
    OUT/errors/part-NNNNNN.parquet          the shard's bad rows (possibly none), written just before it

A shard is done exactly when its results file exists and reads as Parquet; a rerun skips it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa

from genrec.batch import storage
from genrec.batch.shards import Shard
from genrec.batch.spec import run_id_of
from genrec.batch.storage import join
from genrec.errors import GenrecError

RECOMMENDATIONS, RANKINGS, ERRORS, MANIFEST = "recommendations", "rankings", "errors", "manifest.json"


@dataclass(frozen=True)
class ShardCounts:
    rows: int  # result rows
    errors: int


class OutputDir:
    def __init__(self, uri: str, results: str):
        self.uri = uri
        self.fs, self.root = storage.filesystem(uri)
        self.results = join(self.root, results)
        self.errors = join(self.root, ERRORS)

    def open_run(self, identity: dict) -> str:
        """The run_id of `identity`; refuses a directory that holds another run's output."""
        for directory in (self.results, self.errors):
            self.fs.create_dir(directory, recursive=True)
        path = join(self.root, MANIFEST)
        text = storage.read_text(self.fs, path)
        if text is None:
            storage.write_text_atomic(self.fs, path, json.dumps({**identity, "run_id": run_id_of(identity)}, indent=2))
        else:
            recorded = json.loads(text)
            changed = sorted(k for k in identity if recorded.get(k) != identity[k])
            if changed:
                details = ", ".join(f"{k}: {recorded.get(k)!r} -> {identity[k]!r}" for k in changed)
                raise GenrecError(f"{self.uri} holds the output of another run ({details}); use a new output directory")
        return run_id_of(identity)

    def remove_stale_tmp(self) -> int:
        return sum(storage.remove_stale_tmp(self.fs, d) for d in (self.results, self.errors))

    def committed(self, shards: list[Shard]) -> dict[int, ShardCounts]:
        """The shards that are done, with their row counts (one directory listing, then one footer each)."""
        names = storage.files_in(self.fs, self.results)
        done = {}
        for shard in shards:
            if shard.name in names and (counts := self.counts(shard)) is not None:
                done[shard.index] = counts
        return done

    def counts(self, shard: Shard) -> ShardCounts | None:
        rows = storage.parquet_rows(self.fs, join(self.results, shard.name))
        errors = storage.parquet_rows(self.fs, join(self.errors, shard.name)) if rows is not None else None
        return ShardCounts(rows, errors) if errors is not None else None

    def commit(self, shard: Shard, results: pa.Table, errors: pa.Table) -> ShardCounts:
        storage.write_atomic(self.fs, join(self.errors, shard.name), errors)
        storage.write_atomic(self.fs, join(self.results, shard.name), results)  # the commit point
        return ShardCounts(results.num_rows, errors.num_rows)
