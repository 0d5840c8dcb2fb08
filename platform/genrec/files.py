"""How genrec writes a file: atomically, with the modes the umask gives. A temporary file beside the target
(created 0666 less the umask, as any file a user makes; folders 0777 less it), flushed to disk, then renamed into
place: a reader sees the old file or the new one, never half, and a failed write leaves no temporary behind.
Writers that pick their own modes (safetensors' files are 0600) only make the bytes; this writes them.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from genrec.errors import GenrecError

TEMPORARY = ".tmp"  # a file being written: `.<target's name>.<random>.tmp`, beside the target


def write_atomically(target: str | Path, data: bytes) -> Path:
    """`data` as the file `target` (its folders made as needed). Returns the path."""
    target = Path(target)
    if target.is_dir():
        raise GenrecError(f"{target}: is a directory; name the file to write")
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(4)}{TEMPORARY}")
    try:
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _sync_folder(target.parent)
    return target


def is_temporary(path: str | Path) -> bool:
    """A file `write_atomically` is writing now (or a killed writer left), or a catalog run's lock
    (`genrec.catalog_tools.lock`): part of no model or catalog."""
    name = Path(path).name
    return name.startswith(".") and name.endswith(TEMPORARY)


def _sync_folder(folder: Path) -> None:
    """The rename itself made durable (where the filesystem lets a folder be synced)."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)
