"""A retriever replica's catalog, converging on the file its user_config declares (docs/serving.md, "Live changes").

The replica serves the declared file whenever that file is loadable. Until it does (refusing since its start, or kept
running on the catalog before a change it could not load), and after it does (the file may be rewritten in place), it
checks the file every `CHECK_EVERY_S`: a check is one `stat`; the file is read only when its stat changed since the
last try, and swapped in only when its content hash is not the served version (`CatalogVersions.load` finds a version
it holds by hash). Serve sends no reconfigure for an unchanged `user_config`, so nothing else would notice a file that
arrives late (a copy in flight, a volume mounted late) or changes under the same name.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from genrec.errors import GenrecError
from genrec.serving.args import catalog_file

log = logging.getLogger(__name__)

# Convergence's bound: this period plus one load of the catalog (docs/serving.md, "Live changes").
CHECK_EVERY_S = 2.0


class DeclaredCatalog:
    """What a retriever replica declares and serves. `load(path)` serves a catalog file or raises (blocking: it runs
    in a worker thread); `reported()` is called after every try, so the replica can tell its board."""

    def __init__(
        self,
        model_dir: str,
        load: Callable[[Path], object],
        reported: Callable[[], None],
        period_s: float = CHECK_EVERY_S,
    ):
        self.model_dir, self._load, self._reported, self.period_s = model_dir, load, reported, period_s
        self.declared: str | None = None  # as the config names it until resolved, then the path
        self.refused: str | None = None  # why the last try to load the declared file failed (None: it loaded)
        self.refusing = True  # no declared catalog served since the start: requests are refused
        self.not_declared_since: float | None = time.time()  # wall clock; None while it serves the declared file
        self._path: Path | None = None  # the declared file, once resolved
        self._tried: tuple | None = None  # the file's state (`file_state`) at the last try
        self._lock = asyncio.Lock()  # a check and a reconfigure never load at once
        self._watch: asyncio.Task | None = None

    @property
    def status(self) -> str:
        """schemas.CatalogStatus: declared, kept_running or refusing."""
        if self.refusing:
            return "refusing"
        return "kept_running" if self.refused is not None else "declared"

    async def declare(self, catalog: str | None) -> None:
        """A user_config's `catalog` (None: the model directory's own): loaded now, then watched. A failure never
        raises (Serve would tear the replica down, and its replacements fail alike): on a live change the running
        catalog stays (`kept_running`); at start the replica refuses requests (`refusing`) rather than serve the
        model's own catalog, whose items the config may have retired."""
        async with self._lock:
            self.declared, self._path = catalog, None
            try:
                self._path = catalog_file(self.model_dir, catalog)  # an unknown ~user raises
            except Exception as err:  # noqa: BLE001 - see above
                self._failed(f"{catalog}: {err!r}")
            else:
                self.declared = str(self._path)
                await self._try()
        if self._watch is None or self._watch.done():
            self._watch = asyncio.create_task(self.watch())

    def undeclare(self, why: str) -> None:
        """At start, a user_config that does not validate: the catalog it declares is unknown, so none is served."""
        self._failed(why)
        self._reported()

    async def watch(self) -> None:
        """`check` every period, for as long as the replica's event loop runs."""
        while True:
            await asyncio.sleep(self.period_s)
            await self.check()

    async def check(self) -> bool:
        """Try the declared file again if it changed since the last try; True when it did."""
        async with self._lock:
            state = file_state(self._path)
            if state is None or state == self._tried:
                return False
            await self._try()
        return True

    async def _try(self) -> None:
        self._tried = file_state(self._path)  # before reading: a write after it is seen by the next check
        try:
            await asyncio.to_thread(self._load, self._path)
        except Exception as err:  # noqa: BLE001 - see `declare`
            self._failed(str(err) if isinstance(err, GenrecError) else f"{self._path}: {err!r}")
        else:
            if self.status != "declared":
                log.info("genrec: serving the declared catalog %s", self._path)
            self.refused, self.refusing, self.not_declared_since = None, False, None
        self._reported()

    def _failed(self, why: str) -> None:
        self.refused = why
        self.not_declared_since = self.not_declared_since or time.time()
        stays = "requests are refused" if self.refusing else "the running one stays"
        log.error("genrec: catalog %s refused, %s (checked again when it changes): %s", self.declared, stays, why)


def file_state(path: Path | None) -> tuple | None:
    """What tells a file's versions apart without reading it (None: there is none at `path`)."""
    try:
        stat = os.stat(path)
    except (OSError, TypeError, ValueError):
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns
