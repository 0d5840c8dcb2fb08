"""Metrics exported through `ray.serve.metrics`; the series are listed in docs/serving.md, "Metrics".

Series of a replaced replica: Ray's metrics agent (2.60) drops a gauge series not set for two export intervals,
so every gauge here is set again each second while its replica lives and disappears within seconds of it
(checked); the agent keeps counters and histograms as they were until it restarts (a vanished counter would read
as a reset), and no API removes them. They stay constant, so `rate()` and `sum()` over them remain right.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from ray.serve.metrics import Counter, Gauge, Histogram

from genrec.cache.metrics import TotalsCounters, start_at_zero
from genrec.engine.metrics import LATENCY_BUCKETS, OUTCOMES
from genrec.serving.funnel import REASONS

# A retriever replica not serving the catalog its config declares (schemas.CatalogStatus): the states of the gauge.
UNDECLARED = ("kept_running", "refusing")


class EngineMetricsExporter:
    def __init__(self, kinds: Iterable[str] = ()):
        """`kinds`: the request kinds the replica serves, whose counters start at 0."""
        self.requests = Counter("genrec_requests", description="finished engine requests", tag_keys=("kind", "status"))
        start_at_zero(self.requests, ({"kind": k, "status": s} for k in kinds for s in OUTCOMES))
        self.counted: dict[str, int] = {}  # the engine's outcome counts as last exported ("kind:status" -> n)
        self.latency = Histogram(
            "genrec_request_latency_s",
            description="engine request latency, seconds",
            boundaries=list(LATENCY_BUCKETS),
            tag_keys=("kind",),
        )
        self.queue_depth = Gauge("genrec_queue_depth", description="requests waiting for admission")
        self.running = Gauge("genrec_running_requests", description="requests in prefill or decode")
        self.beam_rows = Gauge("genrec_beam_rows_in_flight", description="beam rows of the requests decoding")
        self.context_tokens = Gauge(
            "genrec_context_tokens_in_flight",
            description="context tokens (prompt tokens, history events) of the running requests",
        )
        self.kv_bytes = Gauge("genrec_kv_bytes_reserved", description="KV memory reserved by running requests")
        self.work = Gauge(
            "genrec_work_in_flight",
            description="the work of the requests queued and running (token-equivalents): what genrec's autoscaling "
            "policy scales on (genrec.serving.autoscaling)",
        )
        self.rows_per_step = Gauge("genrec_rows_per_step_p50", description="median decode rows per step (recent)")
        self.prefill_per_step = Gauge(
            "genrec_prefill_tokens_per_step_p50", description="median prefill tokens per step (recent)"
        )
        self.model_load_seconds = Gauge("genrec_model_load_s", description="seconds this replica took to load")
        self.step_in_flight = Gauge(
            "genrec_step_in_flight_s", description="how long the engine's current step has run (0 between steps)"
        )
        self.load_s = 0.0  # set by the replica once loaded; exported with the rest every second
        self.user_config_refused = refused_gauge()
        self.catalog_undeclared = Gauge(
            "genrec_catalog_not_declared",
            description="1: this retriever replica does not serve the catalog its config declares; state kept_running: "
            "it refused a live change and serves the one before, refusing: it answers 503 (none since its start)",
            tag_keys=("state",),
        )
        self.catalog_not_declared_s = Gauge(
            "genrec_catalog_not_declared_s",
            description="how long this retriever replica has not served the catalog its config declares, seconds (0: "
            "it serves it); it converges within a check period plus a load once the file is readable and valid",
        )
        self.catalog_version = Gauge(
            "genrec_catalog_version",
            description="1, tagged with the catalog version this replica serves (none while it refuses for want of "
            "its declared catalog); count by catalog_version shows a rollout's progress",
            tag_keys=("catalog_version",),
        )
        self.prefix_cache = PrefixCacheExporter()

    def answered(self, kind: str, seconds: float) -> None:
        """A request the replica answered, and how long it took there."""
        self.latency.observe(seconds, tags={"kind": kind})

    def export_outcomes(self, counts: dict[str, int]) -> None:
        """genrec_requests: what the engine's outcome count (snapshot `requests`) moved since the last export."""
        for key, n in counts.items():
            if n > self.counted.get(key, 0):
                kind, status = key.split(":")
                self.requests.inc(n - self.counted.get(key, 0), tags={"kind": kind, "status": status})
        self.counted = dict(counts)

    def update(
        self,
        snapshot: dict,
        config_refused: bool = False,
        catalog: str | None = None,
        not_declared_since: float | None = None,
        catalog_version: str | None = None,
        work_in_flight: int = 0,
    ) -> None:
        """`catalog`: the replica's catalog status (declared, kept_running, refusing; None: a ranker's), not the
        declared one since `not_declared_since` (wall clock; None: it is). `catalog_version`: the one it serves (None:
        none). Only the served version is set: the one before stops being set, and Ray's agent drops it."""
        self.model_load_seconds.set(self.load_s)
        self.user_config_refused.set(int(config_refused))
        for state in UNDECLARED:
            self.catalog_undeclared.set(int(catalog == state), tags={"state": state})
        if catalog is not None:
            since = not_declared_since
            self.catalog_not_declared_s.set(0.0 if since is None else max(0.0, time.time() - since))
        if catalog_version is not None:
            self.catalog_version.set(1, tags={"catalog_version": catalog_version})
        self.export_outcomes(snapshot["requests"])
        self.queue_depth.set(snapshot["queue_depth"])
        self.running.set(snapshot["running"])
        self.beam_rows.set(snapshot.get("beam_rows", 0))
        self.context_tokens.set(snapshot.get("context_tokens", 0))
        self.kv_bytes.set(snapshot["kv_bytes_reserved"])
        self.work.set(work_in_flight)
        self.step_in_flight.set(snapshot.get("step_in_flight_s", 0.0))
        self.rows_per_step.set(snapshot["batch_rows_per_step"]["p50"] or 0)
        self.prefill_per_step.set(snapshot["prefill_tokens_per_step"]["p50"] or 0)
        if "prefix_cache" in snapshot:
            self.prefix_cache.update(snapshot["prefix_cache"])


def refused_gauge() -> Gauge:
    return Gauge("genrec_user_config_refused", description="1: the last user_config was refused, old limits stay")


class IngressMetrics:
    """The ingress's answers, its degraded funnel answers, and its `user_config_refused` gauge (set each period)."""

    def __init__(self, period_s: float = 1.0, funnel: bool = False):
        self.responses = Counter(
            "genrec_http_requests", description="HTTP answers of the ingress", tag_keys=("route", "status")
        )
        self.funnel_degraded = Counter(
            "genrec_funnel_degraded",
            description="two-stage recommends answered with the retrieval alone, by why the ranking failed",
            tag_keys=("reason",),
        )
        if funnel:
            start_at_zero(self.funnel_degraded, ({"reason": reason} for reason in REASONS))
        self.user_config_refused = refused_gauge()
        self.refused = False
        threading.Thread(target=self._export, args=(period_s,), name="genrec-metrics", daemon=True).start()

    def answered(self, route: str, status: int) -> None:
        self.responses.inc(tags={"route": route, "status": str(status)})

    def degraded(self, reason: str) -> None:
        self.funnel_degraded.inc(tags={"reason": reason})

    def _export(self, period_s: float) -> None:
        while True:
            self.user_config_refused.set(int(self.refused))
            time.sleep(period_s)


# The engine's cumulative prefix-cache stats exported as counters: name -> (stats key, description).
PREFIX_COUNTERS = {
    "genrec_prefix_cache_tokens_reused": ("tokens_reused", "prompt tokens read from the prefix cache"),
    "genrec_prefix_cache_tokens_prompted": ("tokens_prompted", "prompt tokens of admitted requests"),
    "genrec_prefix_cache_hits": ("hits", "admitted requests that reused at least one block"),
    "genrec_prefix_cache_evictions": ("evictions", "cache entries given back to the KV pool"),
    "genrec_prefix_cache_spills": ("spills", "evicted entries spilled to a host-memory tier"),
}
PREFIX_GAUGES = {
    "genrec_prefix_cache_bytes_held": ("bytes_held", "KV bytes the prefix cache holds"),
    "genrec_prefix_cache_entries": ("entries", "prompts (extents) the prefix cache holds"),
}


class PrefixCacheExporter(TotalsCounters):
    """The engine's prefix-cache totals as counters, and its holdings as gauges."""

    def __init__(self):
        super().__init__(PREFIX_COUNTERS, counter_type=Counter)
        self.gauges = {name: Gauge(name, description=text) for name, (_, text) in PREFIX_GAUGES.items()}

    def update(self, stats: dict) -> None:
        super().update(stats)
        for name, (key, _) in PREFIX_GAUGES.items():
            self.gauges[name].set(stats.get(key, 0))
