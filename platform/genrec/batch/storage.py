"""Files through pyarrow filesystems (a local path or a URI such as s3://...), written atomically.

A file is written under a hidden temporary name and moved to its final name when complete. On a local or
POSIX shared filesystem the move is a rename (atomic); on object stores the final object appears whole. So a
final name either does not exist or holds a complete file, whenever the writer is killed.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from genrec.errors import GenrecError

TMP_SUFFIX = ".tmp"


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it); a plain path is taken relative to the current directory."""
    if "://" not in uri:
        uri = str(Path(uri).expanduser().resolve())
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
        raise GenrecError(f"{uri}: not a usable path or filesystem URI ({err})") from None


def join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts)


def write_atomic(fs: pafs.FileSystem, path: str, table: pa.Table) -> None:
    """Write `table` as Parquet at `path`: nobody ever sees a partial file under that name."""
    parent, name = path.rsplit("/", 1)
    tmp = f"{parent}/.{name}.{uuid.uuid4().hex}{TMP_SUFFIX}"  # hidden: Parquet dataset readers skip it
    with fs.open_output_stream(tmp) as stream:
        pq.write_table(table, stream)
    fs.move(tmp, path)


def write_text_atomic(fs: pafs.FileSystem, path: str, text: str) -> None:
    parent, name = path.rsplit("/", 1)
    tmp = f"{parent}/.{name}.{uuid.uuid4().hex}{TMP_SUFFIX}"
    with fs.open_output_stream(tmp) as stream:
        stream.write(text.encode())
    fs.move(tmp, path)


def probe_write(fs: pafs.FileSystem, directory: str) -> None:
    """Write and delete a hidden temporary file in `directory`: raises (OSError, ArrowException) where it cannot.
    A probe left by a killed writer is a stale temporary (remove_stale_tmp)."""
    probe = f"{directory}/.probe.{uuid.uuid4().hex}{TMP_SUFFIX}"
    with fs.open_output_stream(probe) as stream:
        stream.write(b"")
    fs.delete_file(probe)


def read_text(fs: pafs.FileSystem, path: str) -> str | None:
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return None
    with fs.open_input_stream(path) as stream:
        return stream.read().decode()


def parquet_rows(fs: pafs.FileSystem, path: str) -> int | None:
    """Rows of a complete Parquet file, or None when it is missing or unreadable (e.g. cut by a machine crash)."""
    try:
        with fs.open_input_file(path) as handle:
            return pq.ParquetFile(handle).metadata.num_rows
    except (OSError, pa.ArrowException):
        return None


def files_in(fs: pafs.FileSystem, directory: str) -> set[str]:
    """Base names of the visible files in a directory (empty when it does not exist)."""
    selector = pafs.FileSelector(directory, allow_not_found=True)
    return {info.base_name for info in fs.get_file_info(selector) if info.type == pafs.FileType.File}


def remove_stale_tmp(fs: pafs.FileSystem, directory: str) -> int:
    """Delete temporary files left by writers that were killed; returns how many."""
    selector = pafs.FileSelector(directory, allow_not_found=True)
    stale = [i.path for i in fs.get_file_info(selector) if i.base_name.startswith(".") and i.path.endswith(TMP_SUFFIX)]
    for path in stale:
        try:
            fs.delete_file(path)
        except FileNotFoundError:  # a late writer of the killed run moved it meanwhile
            pass
    return len(stale)
