"""Whole-file digests of a model directory's large files, recorded in `genrec/digests.json` the first time they
are read, so a replica start does not read gigabytes of weights a second time only to name the model version.

An entry is trusted while the file keeps its size and modification time (as make and git's index do); any
other file, or a changed one, is hashed again. Headers and sizes alone would not do: a fine-tune keeps every
shape, so two fine-tunes would share a version. Recording is best effort: a read-only directory (an image, a
read-only volume) is hashed at every start unless it was recorded before it was made read-only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from pathlib import Path

from genrec.files import write_atomically

RECORD = "digests.json"
LARGE_BYTES = 16 << 20  # below this a file is hashed at every call (config, tokenizer, projector, catalog)
# A file modified this shortly before it is read is not recorded: on a coarse clock, an edit in the same tick
# would keep its modification time.
SETTLE_NS = 2_000_000_000


def file_sha256(path: Path) -> bytes:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").digest()


class DigestRecord:
    """The recorded digests of one model directory's large files (relative POSIX path -> entry)."""

    def __init__(self, path: Path):
        self.path = path
        self.recorded = _read(path)
        self.seen: dict[str, dict] = {}

    def owns(self, file: Path) -> bool:
        """The record itself and its temporaries: never part of the version."""
        return file.parent == self.path.parent and file.name.startswith(RECORD)

    def digest(self, file: Path, name: str) -> bytes:
        before = file.stat()
        if before.st_size < LARGE_BYTES:
            return file_sha256(file)
        key = {"size": before.st_size, "mtime_ns": before.st_mtime_ns}
        entry = self.recorded.get(name)
        if _fresh(entry, key):
            self.seen[name] = entry
            return bytes.fromhex(entry["sha256"])
        settled = time.time_ns() - before.st_mtime_ns > SETTLE_NS
        value = file_sha256(file)
        after = file.stat()
        if settled and (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns):
            self.seen[name] = {**key, "sha256": value.hex()}
        return value

    def save(self) -> None:
        """Write what this pass saw, if it differs from the record (atomically; a read-only directory is fine)."""
        if self.seen == self.recorded or not self.path.parent.is_dir():
            return
        with contextlib.suppress(OSError):
            write_atomically(self.path, json.dumps(self.seen, indent=1, sort_keys=True).encode())


def _fresh(entry, key: dict) -> bool:
    if not isinstance(entry, dict) or any(entry.get(k) != v for k, v in key.items()):
        return False
    value = entry.get("sha256")
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _read(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}
