"""The embedding cache's lookups as Prometheus series, exported by each shard's actor (docs/serving.md, "Metrics").

The shard counts, not its callers: the Serve ingress and the batch jobs share one cache, and only the shard's table
knows whether a key was resident. Its cumulative `TableStats` become counter increments once a second, off the
actor's request path (a lookup pays nothing for them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ray.util.metrics import Counter

from genrec.cache.table import TableStats

# Series -> (the TableStats field it follows, description).
CACHE_COUNTERS = {
    "genrec_embedding_cache_hits": ("hits", "keys found in the shard's in-memory table"),
    "genrec_embedding_cache_misses": ("misses", "keys not in the shard's table (read through to its store, if any)"),
    "genrec_embedding_cache_store_hits": ("store_hits", "missed keys the shard's store had"),
}
TAG_KEYS = ("cache", "shard")


class CacheMetrics:
    """One shard's counters, tagged with the cache's name and the shard's number."""

    def __init__(self, cache: str, shard: int):
        self.tags = {"cache": cache, "shard": str(shard)}
        self.counters = {
            name: Counter(name, description=text, tag_keys=TAG_KEYS) for name, (_, text) in CACHE_COUNTERS.items()
        }
        for counter in self.counters.values():
            # At 0 before the first lookup, so rate() counts the first lookups too (a series that appears at N counts
            # from N). As serving.metrics.start_at_zero: Counter.inc refuses 0, the recording it wraps does not.
            counter._record(0, self.tags)
        self.last = dict.fromkeys(CACHE_COUNTERS, 0)

    def update(self, stats: TableStats) -> None:
        """Advance each counter by what its field grew since the last update (a counter only increments)."""
        for name, (field, _) in CACHE_COUNTERS.items():
            now = getattr(stats, field)
            if now > self.last[name]:
                self.counters[name].inc(now - self.last[name], tags=self.tags)
            self.last[name] = now

    def export_every(self, stats: Callable[[], TableStats | None], period_s: float = 1.0) -> None:
        """Update from `stats()` every period in a daemon thread, for the life of the process (None: no table yet,
        its store has not opened)."""
        threading.Thread(target=self._export, args=(stats, period_s), name="genrec-cache-metrics", daemon=True).start()

    def _export(self, stats: Callable[[], TableStats | None], period_s: float) -> None:
        while True:
            if (found := stats()) is not None:
                self.update(found)
            time.sleep(period_s)
