"""One catalog version as a decoder serves it: the catalog, its host trie, its compiled filters (`FilterMasks`: per
filter, a mask over the trie's nodes, cached). A request keeps the version it was prepared with to its end
(`CatalogVersions` swaps them). All is built on the host, in any thread; device copies (`device_trie`,
`FilterMask.on`) are made by the engine's thread on first use, so no other thread issues device work that could meet
a CUDA graph capture or stall the engine's stream (docs/engine.md, 'Filters'; 'Catalog versions, live: `load_catalog`
/ `rollback_catalog`').
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from genrec.catalog import Catalog, CodeTrie
from genrec.catalog.catalog import read_catalog_file, version_of
from genrec.catalog.filters import Attributes, allowed_items
from genrec.errors import CatalogError

FILTER_CACHE_BYTES = 256 << 20  # a 1 M-item, 3-level catalog's mask takes 3.0 MB: some 85 distinct filters


@dataclass(frozen=True)
class FilterMask:
    items: np.ndarray  # [N] bool, host: the items allowed
    nodes: list[torch.Tensor]  # per decode step l: [nodes at depth l + 1] bool on the host, allowed below
    allowed: int  # items allowed
    _on_device: dict = field(default_factory=dict, compare=False, repr=False)  # device -> its copy of `nodes`

    @property
    def nbytes(self) -> int:
        return self.items.nbytes + 2 * sum(t.numel() for t in self.nodes)  # host masks and one device copy

    @classmethod
    def build(cls, items: np.ndarray, trie: CodeTrie) -> FilterMask:
        """One scatter per depth: the nodes of the allowed items (no sort, no count over all items)."""
        index = np.flatnonzero(items)
        nodes = []
        for depth in range(1, trie.levels + 1):
            mask = np.zeros(trie.nodes_at(depth), dtype=bool)
            mask[trie.node_of_item[depth - 1][index]] = True
            nodes.append(torch.from_numpy(mask))
        return cls(items, nodes, len(index))

    def on(self, device) -> list[torch.Tensor]:
        """`nodes` on the device, copied once (asynchronously, from pinned memory). The engine's thread only."""
        device = torch.device(device)
        if device.type == "cpu":
            return self.nodes
        if device not in self._on_device:
            pinned = [n.pin_memory() for n in self.nodes] if device.type == "cuda" else self.nodes
            self._on_device[device] = [n.to(device, non_blocking=True) for n in pinned]
        return self._on_device[device]

    def allowed_under(self, trie: CodeTrie, depth: int, nodes: np.ndarray) -> np.ndarray:
        """[len(nodes)] the allowed items below each depth-`depth` node: a node's items are one run of the trie's
        code order (`CodeTrie.first_item`), so this reads only the runs of the nodes asked for."""
        starts, sizes = trie.first_item[depth - 1][nodes], trie.leaves[depth - 1][nodes]
        if not len(nodes):
            return np.zeros(0, dtype=np.int64)
        offsets = np.cumsum(sizes) - sizes
        runs = np.repeat(starts - offsets, sizes) + np.arange(int(sizes.sum()))
        return np.add.reduceat(self.items[trie.code_items[runs]].astype(np.int64), offsets)


class FilterMasks:
    """The compiled filters of one catalog version (its trie), least recently used first, at most `max_bytes`."""

    def __init__(self, catalog: Catalog, trie: CodeTrie, max_bytes: int = FILTER_CACHE_BYTES):
        self.attributes, self.trie, self.max_bytes = Attributes(catalog), trie, max_bytes
        self._masks: OrderedDict[str, FilterMask] = OrderedDict()
        self._bytes = self.hits = self.misses = 0
        self.retired = False  # its version is no longer served (retire)
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._masks)

    def get(self, request) -> FilterMask | None:
        """The request's mask (None: it has no filter). Raises InvalidRequestError naming a bad field; compiled
        outside the lock, so a slow compile holds up no other request."""
        if not request.filtered:
            return None
        key = _key(request)
        with self._lock:
            found = self._masks.get(key)
            if found is not None:
                self._masks.move_to_end(key)
                self.hits += 1
                return found
            self.misses += 1
        items = allowed_items(self.attributes, request.filters, request.allowed_item_ids)
        mask = FilterMask.build(items, self.trie)
        self._remember(key, mask)
        return mask

    def retire(self) -> None:
        """Forget every mask and keep no new one (a request holding one keeps it; one prepared just before the swap
        still compiles its own): a version no longer served holds no device memory."""
        with self._lock:
            self._masks.clear()
            self._bytes, self.retired = 0, True

    def reinstate(self) -> None:  # served again (a rollback)
        self.retired = False

    def _remember(self, key: str, mask: FilterMask) -> None:
        with self._lock:
            old = self._masks.pop(key, None)  # another thread compiled it meanwhile
            if old is not None:
                self._bytes -= old.nbytes
            if mask.nbytes > self.max_bytes or self.retired:
                return  # larger than the whole cache, or the version is no longer served: used, not kept
            self._masks[key] = mask
            self._bytes += mask.nbytes
            while self._bytes > self.max_bytes:
                _, evicted = self._masks.popitem(last=False)
                self._bytes -= evicted.nbytes


def _key(request) -> str:
    """The filter as given, canonically: the same conditions in another key order are one entry."""
    filters = request.model_dump(mode="json", include={"filters", "allowed_item_ids"}, exclude_none=True)
    text = json.dumps(filters, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


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
        """The host trie (the layout's ending tokens after every code) and an empty filter cache."""
        trie = CodeTrie.build(catalog.codes, "cpu", catalog.lengths, layout.ending, catalog.popularity)
        return cls(catalog, trie, FilterMasks(catalog, trie, filter_cache_bytes), torch.device(device))

    def device_trie(self) -> CodeTrie:
        """The trie on the device, made once (cohorts of one version group by the object). The engine's thread only."""
        if not self._on_device:
            self._on_device.append(self.trie if self.device.type == "cpu" else self.trie.to(self.device))
        return self._on_device[0]


class CatalogVersions:
    """The served catalog and the one before it (a rollback target). `load` builds a version in the caller's thread;
    `use` makes it current by one reference assignment, seen by the next request prepared."""

    def __init__(self, first: ServedCatalog, layout, device, max_steps: int):
        self.current, self.previous = first, None
        self.layout, self.device, self.max_steps = layout, device, max_steps
        self.filter_cache_bytes = first.filters.max_bytes  # each version its own cache of this bound
        self._lock = threading.Lock()  # one change at a time; requests read `current` without it

    def load(self, path: str | Path) -> ServedCatalog:
        """The catalog file checked against the model's SID layout and built, not yet served. Raises CatalogError."""
        data = read_catalog_file(Path(path))  # hashed and parsed from these bytes: one version, whatever the file does
        version = version_of(data, Path(path))
        for known in (self.current, self.previous):  # a version already built (a rollback): found by its hash alone
            if known is not None and known.version == version:
                return known
        catalog = Catalog.load(Path(path), self.layout, data)
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
