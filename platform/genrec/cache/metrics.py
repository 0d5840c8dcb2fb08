"""The embedding cache's lookups as Prometheus series, exported by each shard's actor (docs/serving.md, "Metrics").

The shard counts, not its callers: the Serve ingress and the batch jobs share one cache, and only the shard's table
knows whether a key was resident. Its cumulative `TableStats` become counter increments once a second, off the
actor's request path (a lookup pays nothing for them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from ray.util.metrics import Counter

from genrec.cache.table import TableStats

# Series -> (the TableStats field it follows, description).
CACHE_COUNTERS = {
    "genrec_embedding_cache_hits": ("hits", "keys found in the shard's in-memory table"),
    "genrec_embedding_cache_misses": ("misses", "keys not in the shard's table (read through to its store, if any)"),
    "genrec_embedding_cache_store_hits": ("store_hits", "missed keys the shard's store had"),
}


def start_at_zero(counter: Counter, tag_sets: Iterable[dict[str, str]] = ({},)) -> None:
    """Publish each series at 0 before it first moves, so rate() counts the first increments too (a series that
    appears at N counts from N). Counter.inc refuses 0; the recording it wraps does not, and Ray's agent exports the
    series at 0 (checked on Ray 2.60). A Serve counter adds the replica's default tags alike."""
    for tags in tag_sets:
        counter._record(0, tags)


class TotalsCounters:
    """Counters that follow cumulative totals (name -> (the total's key, description)): each update advances a
    counter by what its total grew since the last one, as a counter only increments. `counter_type`: Ray's
    `ray.util.metrics.Counter`, or Serve's, which adds the replica's tags; `tags`: this source's own."""

    def __init__(self, specs: dict[str, tuple[str, str]], counter_type=None, tags: dict[str, str] | None = None):
        self.specs, self.tags = specs, tags or {}
        counter_type = counter_type or Counter  # looked up now: a test may stand in for it
        self.counters = {
            name: counter_type(name, description=text, tag_keys=tuple(self.tags)) for name, (_, text) in specs.items()
        }
        for counter in self.counters.values():
            start_at_zero(counter, (self.tags,))
        self.last = dict.fromkeys(specs, 0)

    def update(self, totals: dict) -> None:
        for name, (key, _) in self.specs.items():
            grown = totals.get(key, 0) - self.last[name]
            if grown > 0:
                self.counters[name].inc(grown, tags=self.tags)
                self.last[name] = totals[key]


class CacheMetrics(TotalsCounters):
    """One shard's counters, tagged with the cache's name and the shard's number."""

    def __init__(self, cache: str, shard: int):
        super().__init__(CACHE_COUNTERS, tags={"cache": cache, "shard": str(shard)})

    def update(self, stats: TableStats) -> None:
        super().update(vars(stats))

    def export_every(self, stats: Callable[[], TableStats | None], period_s: float = 1.0) -> None:
        """Update from `stats()` every period in a daemon thread, for the life of the process (None: no table yet,
        its store has not opened)."""
        threading.Thread(target=self._export, args=(stats, period_s), name="genrec-cache-metrics", daemon=True).start()

    def _export(self, stats: Callable[[], TableStats | None], period_s: float) -> None:
        while True:
            if (found := stats()) is not None:
                self.update(found)
            time.sleep(period_s)
