"""One `genrec catalog` run at a time rewrites a catalog file: `catalog_lock(path)` is held from before the run reads
the catalog until it has replaced it, so two runs at once both land (the second reads what the first wrote) instead
of the last one's write dropping the first one's items.

The lock is flock(2) on a file beside the catalog, `.<name>.lock.tmp`: the kernel drops it when its holder ends,
killed with SIGKILL included, so a crashed run leaves nothing to clear by hand. Named as a temporary
(`genrec.files.is_temporary`): part of no model or catalog, so no version counts it. The holder writes its pid in it
(for the message of a run that waits) and removes it when done; a run that finds it held says so on stderr, waits up
to `WAIT_S`, then fails with one line.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from genrec.errors import GenrecError
from genrec.files import TEMPORARY

WAIT_S = 60.0  # how long a run waits for another run's change of the same catalog
POLL_S = 0.05


def lock_path(catalog: str | Path) -> Path:
    catalog = Path(catalog)
    return catalog.with_name(f".{catalog.name}.lock{TEMPORARY}")


@contextmanager
def catalog_lock(catalog: str | Path, wait_s: float = WAIT_S) -> Iterator[None]:
    """`catalog` locked against other genrec runs while the block runs (the module doc)."""
    path = lock_path(catalog)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = _acquire(path, Path(catalog), wait_s)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # while still held: a run waiting on this file then finds it gone and starts over
        os.close(handle)


def _acquire(path: Path, catalog: Path, wait_s: float) -> int:
    """The lock, once free (saying on stderr that it waits), with this run's pid in it; a GenrecError past `wait_s`."""
    deadline = time.monotonic() + wait_s
    waited = False
    while (handle := _try_lock(path)) is None:
        holder = _holder(path)
        if time.monotonic() >= deadline:
            raise GenrecError(
                f"{catalog} is being changed by another genrec catalog run ({holder}); waited {wait_s:g} s: run "
                "again once it has ended"
            )
        if not waited:
            message = f"waiting up to {wait_s:g} s for {catalog}: another genrec catalog run ({holder}) is changing it"
            print(f"genrec: {message}", file=sys.stderr, flush=True)
            waited = True
        time.sleep(POLL_S)
    os.ftruncate(handle, 0)
    os.write(handle, f"{os.getpid()}\n".encode())
    return handle


def _try_lock(path: Path) -> int | None:
    """A descriptor holding the lock file `path` exclusively, or None while another holds it."""
    while True:
        handle = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)  # the umask applies
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(handle)
            return None
        if _still_named(path, handle):
            return handle
        os.close(handle)  # its last holder removed it as this run opened it: the lock is the file now named so


def _still_named(path: Path, handle: int) -> bool:
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(handle)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _holder(path: Path) -> str:
    try:
        pid = path.read_text().strip()
    except OSError:
        pid = ""
    return f"pid {pid}" if pid.isdigit() else "pid unknown"
