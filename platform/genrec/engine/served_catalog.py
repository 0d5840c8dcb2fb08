"""One catalog version as a decoder serves it: the catalog, its trie, its version, the filters compiled against it
(masks over its trie: genrec.engine.filter_masks).

Built on the host, in whichever thread loads it; its device copy is made by the engine's own thread on first use
(`device_trie`), so a catalog load or a filter compiled beside a running engine issues no device work that could
meet a CUDA graph capture or stall the engine's stream.

A request takes the decoder's current `ServedCatalog` when it is prepared and keeps it to the end (its exclusions,
its beams, its results), so a catalog swapped in meanwhile (`CatalogVersions`) never changes a request in flight.
Nothing here touches the model: a catalog changes which codes may be generated, not any K/V, so the prefix cache
holds across catalog versions.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from genrec.catalog import Catalog, CodeTrie
from genrec.catalog.catalog import catalog_version
from genrec.engine.filter_masks import FILTER_CACHE_BYTES, FilterMasks
from genrec.errors import CatalogError


@dataclass(frozen=True)
class ServedCatalog:
    catalog: Catalog
    trie: CodeTrie  # on the host
    filters: FilterMasks = field(default=None, compare=False)  # its compiled filters, cached (by `build`)
    device: torch.device = field(default=torch.device("cpu"), compare=False)
    _on_device: list = field(default_factory=list, compare=False, repr=False)  # the device trie, once made

    @property
    def version(self) -> str:
        return self.catalog.version

    @classmethod
    def build(cls, catalog: Catalog, layout, device, filter_cache_bytes: int = FILTER_CACHE_BYTES) -> ServedCatalog:
        """The catalog's trie built on the host (with the layout's ending tokens after every code), and an empty
        cache of its compiled filters of at most `filter_cache_bytes`."""
        trie = CodeTrie.build(catalog.codes, "cpu", catalog.lengths, layout.ending, catalog.popularity)
        return cls(catalog, trie, FilterMasks(catalog, trie, filter_cache_bytes), torch.device(device))

    def device_trie(self) -> CodeTrie:
        """The trie on the engine's device: made on first call, then the same object (cohorts of one version group
        by it). Call it from the engine's thread only (the one stepping the scheduler)."""
        if not self._on_device:
            self._on_device.append(self.trie if self.device.type == "cpu" else self.trie.to(self.device))
        return self._on_device[0]


class CatalogVersions:
    """The served catalog and the one before it (a rollback target), swapped atomically.

    `load` builds a version off the serving loop (the caller's thread) and checks it against what the engine was
    sized for; `use` makes it current: one reference assignment, seen by the next request prepared. Loading the
    version served before is a swap back, nothing rebuilt.
    """

    def __init__(self, first: ServedCatalog, layout, device, max_steps: int):
        self.current, self.previous = first, None
        self.layout, self.device, self.max_steps = layout, device, max_steps
        self.filter_cache_bytes = first.filters.max_bytes  # each version its own cache of this bound
        self._lock = threading.Lock()  # one change at a time; requests read `current` without it

    def load(self, path: str | Path) -> ServedCatalog:
        """The catalog file checked against the model's SID layout and built, not yet served. Raises CatalogError."""
        version = catalog_version(path) if Path(path).is_file() else None
        for known in (self.current, self.previous):  # a version already built (a rollback): found by its hash alone
            if known is not None and version is not None and known.version == version:
                return known
        catalog = Catalog.load(Path(path), self.layout, version)  # the file hashed once
        served = ServedCatalog.build(catalog, self.layout, self.device, self.filter_cache_bytes)
        if served.trie.levels > self.max_steps:
            raise CatalogError(
                path,
                f"its codes take {served.trie.levels} decode steps; this engine was sized for at most "
                f"{self.max_steps} (the catalog it started with): restart it to serve longer codes",
            )
        return served

    def use(self, served: ServedCatalog) -> ServedCatalog:
        """Serve `served` from the next request on; the one it replaces is kept as `previous`. Returns it."""
        with self._lock:
            if served is not self.current:
                self.previous, self.current = self.current, served
                self._swapped()
            return served

    def rollback(self) -> ServedCatalog:
        """Serve the previous version again (the current one becomes `previous`)."""
        with self._lock:
            if self.previous is None:
                raise CatalogError("catalog", "no previous catalog version to roll back to")
            self.previous, self.current = self.current, self.previous
            self._swapped()
            return self.current

    def _swapped(self) -> None:
        """The replaced version's masks are dropped (rebuilt on a rollback), the served one's cached again."""
        self.previous.filters.retire()
        self.current.filters.reinstate()

    def describe(self) -> dict:
        return {
            "catalog_version": self.current.version,
            "previous_catalog_version": self.previous.version if self.previous is not None else None,
        }
