"""The output directory of a run, through a pyarrow filesystem (a local path or a URI such as s3://...):

    OUT/manifest.json                   the run's identity (args, model version, input fingerprint, run_id)
    OUT/<results>/part-NNNNNN.parquet   one per input shard, its commit point (`recommendations/` or `rankings/`)
    OUT/errors/part-NNNNNN.parquet      the shard's bad rows (possibly none), written just before it

Every file is written under a hidden temporary name and moved into place when complete (on object stores the
object appears whole), so a shard is done exactly when its results file reads as Parquet, whenever a writer dies.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from genrec.batch.shards import Shard, filesystem
from genrec.batch.spec import run_id_of
from genrec.batch.tables import degraded_users
from genrec.errors import GenrecError

RECOMMENDATIONS, RANKINGS, ERRORS, MANIFEST = "recommendations", "rankings", "errors", "manifest.json"
TMP_SUFFIX = ".tmp"
# A temporary this much older than now (by its modification time) is a killed writer's: a live one writes its file
# and moves it into place at once, and a run started meanwhile into the same output (same settings) must not
# delete it. Far above a shard file's write, and above any clock skew between the driver and an object store.
STALE_TMP_AGE_S = 3600.0


@dataclass(frozen=True)
class ShardCounts:
    rows: int  # result rows
    errors: int
    degraded: int = 0  # funnel users whose stage 1 order was kept because the ranker failed


DEGRADED_KEY = b"genrec.degraded_users"  # in a funnel results file's footer: its degraded users


class OutputDir:
    def __init__(self, uri: str, results: str):
        self.uri = uri
        self.fs, self.root = filesystem(uri)
        self.results, self.errors, self.manifest = (f"{self.root.rstrip('/')}/{n}" for n in (results, ERRORS, MANIFEST))
        self.new_run = False  # open_run wrote the manifest

    @contextmanager
    def _writing(self) -> Iterator[None]:
        try:
            yield
        except (OSError, pa.ArrowException) as err:
            raise GenrecError(f"{self.uri}: cannot write the output directory ({err})") from None

    def open_run(self, identity: dict) -> str:
        """The run_id of `identity`; refuses a directory that holds another run's output."""
        with self._writing():
            for directory in (self.results, self.errors):
                self.fs.create_dir(directory, recursive=True)
            found = self.fs.get_file_info(self.manifest).type != pafs.FileType.NotFound
            self.new_run = not found
            if found:
                with self.fs.open_input_stream(self.manifest) as stream:
                    recorded = json.loads(stream.read().decode())
            else:
                text = json.dumps({**identity, "run_id": run_id_of(identity)}, indent=2)
                recorded = self._create(self.manifest, text.encode())
                found = recorded is not None  # another run wrote its manifest since we looked
                self.new_run = not found
        if found:
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
                self.fs.delete_file(self.manifest)
            self.new_run = False

    def remove_stale_tmp(self) -> int:
        """Delete the temporary files of writers that were killed: those older than STALE_TMP_AGE_S (a younger one
        may be a live run's, being written; one whose filesystem gives no time stays). Returns how many."""
        before = time.time() - STALE_TMP_AGE_S
        with self._writing():
            stale = [
                info.path
                for directory in (self.results, self.errors)
                for info in self.fs.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
                if info.base_name.startswith(".")
                and info.path.endswith(TMP_SUFFIX)
                and info.mtime is not None
                and info.mtime.timestamp() < before
            ]
            for path in stale:
                try:
                    self.fs.delete_file(path)
                except FileNotFoundError:  # a late writer of the killed run moved it meanwhile
                    pass
        return len(stale)

    def check_writable(self) -> None:
        """Refuse, before any work, an output whose shard files could not be written (e.g. read-only, manifest in)."""
        with self._writing():
            for directory in (self.results, self.errors):
                probe = f"{directory}/.probe.{uuid.uuid4().hex}{TMP_SUFFIX}"  # if left: a stale temporary
                with self.fs.open_output_stream(probe) as stream:
                    stream.write(b"")
                self.fs.delete_file(probe)

    def committed(self, shards: list[Shard]) -> dict[int, ShardCounts]:
        """The shards that are done, with their row counts (one directory listing, then one footer each)."""
        listed = self.fs.get_file_info(pafs.FileSelector(self.results, allow_not_found=True))
        names = {info.base_name for info in listed if info.type == pafs.FileType.File}
        counts = {shard.index: self.counts(shard) for shard in shards if shard.name in names}
        return {index: done for index, done in counts.items() if done is not None}

    def counts(self, shard: Shard) -> ShardCounts | None:
        results = self._footer(f"{self.results}/{shard.name}")
        errors = self._footer(f"{self.errors}/{shard.name}") if results is not None else None
        if errors is None:
            return None
        degraded = int((results.metadata or {}).get(DEGRADED_KEY, b"0"))
        return ShardCounts(results.num_rows, errors.num_rows, degraded)

    def commit(self, shard: Shard, results: pa.Table, errors: pa.Table) -> ShardCounts:
        degraded = degraded_users(results)
        if degraded:  # counted once here, read from the footer when a rerun finds the shard committed
            metadata = {**(results.schema.metadata or {}), DEGRADED_KEY: str(degraded).encode()}
            results = results.replace_schema_metadata(metadata)
        self._write(f"{self.errors}/{shard.name}", lambda stream: pq.write_table(errors, stream))
        self._write(f"{self.results}/{shard.name}", lambda stream: pq.write_table(results, stream))  # the commit
        return ShardCounts(results.num_rows, errors.num_rows, degraded)

    def _write(self, path: str, write: Callable) -> None:
        """`write(stream)` to a hidden temporary file (Parquet dataset readers skip it), then moved to `path`."""
        parent, name = path.rsplit("/", 1)
        tmp = f"{parent}/.{name}.{uuid.uuid4().hex}{TMP_SUFFIX}"
        with self.fs.open_output_stream(tmp) as stream:
            write(stream)
        self.fs.move(tmp, path)

    def _create(self, path: str, data: bytes) -> dict | None:
        """Write `data` at `path` unless another writer got there first; returns None, or what that writer wrote
        (an identity equal to ours too: then the other run owns the manifest, and abandon_new_run leaves it).
        Two runs started at once into one directory both find no manifest: without this, both went on, each with its
        own identity, and their shards mixed. On a local filesystem the file is linked into place (atomic, and fails
        if it exists); an object store has no create-if-absent here, so the file is read back: a run whose manifest
        was overwritten meanwhile sees the other's and is refused (a narrow window stays)."""
        parent, name = path.rsplit("/", 1)
        exists = False
        if isinstance(self.fs, pafs.LocalFileSystem):
            tmp = f"{parent}/.{name}.{uuid.uuid4().hex}{TMP_SUFFIX}"
            with self.fs.open_output_stream(tmp) as stream:
                stream.write(data)
            try:
                os.link(tmp, path)
                return None
            except FileExistsError:
                exists = True  # another run linked its manifest first: read it
            except OSError:  # a filesystem without hard links: moved and read back, as on an object store
                pass
            finally:
                self.fs.delete_file(tmp)
        if not exists:
            self._write(path, lambda stream: stream.write(data))
        with self.fs.open_input_stream(path) as stream:
            found = stream.read()
        return json.loads(found.decode()) if exists or found != data else None

    def _footer(self, path: str) -> pq.FileMetaData | None:
        """The footer of a complete Parquet file; None: missing or unreadable (e.g. cut by a machine crash)."""
        try:
            with self.fs.open_input_file(path) as handle:
                return pq.ParquetFile(handle).metadata
        except (OSError, pa.ArrowException):
            return None
