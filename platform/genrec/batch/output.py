"""The output directory of a run:

    OUT/manifest.json                      the run's identity (args, model version, input fingerprint, run_id)
    OUT/recommendations/part-NNNNNN.parquet one file per input shard: the commit point of that shard (the
                                           results folder: `recommendations/`, or the rank job's `rankings/`)
    OUT/errors/part-NNNNNN.parquet          the shard's bad rows (possibly none), written just before it

A shard is done exactly when its results file exists and reads as Parquet; a rerun skips it. An output the
driver cannot write (a file in the way, no permission, a parent it cannot create) is one GenrecError naming it,
raised before any work.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
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
        self.new_run = False  # open_run wrote the manifest

    @contextmanager
    def _writing(self) -> Iterator[None]:
        try:
            yield
        except (OSError, pa.ArrowException) as err:
            raise GenrecError(f"{self.uri}: cannot write the output directory ({err})") from None

    def open_run(self, identity: dict) -> str:
        """The run_id of `identity`; refuses a directory that holds another run's output."""
        path = join(self.root, MANIFEST)
        with self._writing():
            for directory in (self.results, self.errors):
                self.fs.create_dir(directory, recursive=True)
            text = storage.read_text(self.fs, path)
            self.new_run = text is None
            if text is None:
                manifest = json.dumps({**identity, "run_id": run_id_of(identity)}, indent=2)
                storage.write_text_atomic(self.fs, path, manifest)
        if text is not None:
            recorded = json.loads(text)
            changed = sorted(k for k in identity if recorded.get(k) != identity[k])
            # Settings only the recorded run has (e.g. a funnel's ranker) make it another run, too.
            changed += sorted(k for k in recorded.keys() - identity.keys() - {"run_id"} if recorded[k] is not None)
            if changed:
                details = ", ".join(f"{k}: {recorded.get(k)!r} -> {identity.get(k)!r}" for k in changed)
                raise GenrecError(f"{self.uri} holds the output of another run ({details}); use a new output directory")
        return run_id_of(identity)

    def abandon_new_run(self) -> None:
        """Remove the manifest open_run wrote, for a run refused before any work: a rerun may change settings."""
        if self.new_run:
            with self._writing():
                self.fs.delete_file(join(self.root, MANIFEST))
            self.new_run = False

    def remove_stale_tmp(self) -> int:
        with self._writing():
            return sum(storage.remove_stale_tmp(self.fs, d) for d in (self.results, self.errors))

    def check_writable(self) -> None:
        """Refuse, before any work, an output whose shard files could not be written (e.g. a read-only directory
        that holds a run's manifest already)."""
        with self._writing():
            for directory in (self.results, self.errors):
                storage.probe_write(self.fs, directory)

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
