"""Plain counters and histograms kept by the engine loop; the Serve layer exports them. `EngineMetrics.requests`
is the one count of how requests end, by kind and outcome: the scheduler counts those it queued, `AsyncEngine.submit`
those it refused, and a caller refusing one before submitting (a Serve replica not serving its catalog) counts it too.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable

from genrec.errors import GenrecError

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SIZE_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
# How a request ends; "error": anything not meant (a bug). catalog_not_served: a Serve replica's refusal.
OUTCOMES = ("ok", "cancelled", "invalid", "overloaded", "timeout", "stopped", "catalog_not_served", "error")


def outcome_of(err: BaseException) -> str:
    """How a request that failed ends: the error's own outcome (genrec.errors), cancelled, or error."""
    if isinstance(err, asyncio.CancelledError | concurrent.futures.CancelledError):
        return "cancelled"
    return err.outcome if isinstance(err, GenrecError) else "error"


class Histogram:
    """Cumulative bucket counts (Prometheus style) plus a window of recent values for quantiles."""

    def __init__(self, buckets=LATENCY_BUCKETS, window: int = 4096):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.count = 0
        self.sum = 0.0
        self.recent: deque[float] = deque(maxlen=window)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.count += 1
        self.sum += value
        self.recent.append(value)

    def quantile(self, q: float) -> float | None:
        if not self.recent:
            return None
        ordered = sorted(self.recent)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def snapshot(self) -> dict:
        return {
            "count": self.count,
            "sum": self.sum,
            "p50": self.quantile(0.5),
            "p90": self.quantile(0.9),
            "p99": self.quantile(0.99),
            "buckets": dict(zip([*map(str, self.buckets), "+Inf"], self.counts, strict=True)),
        }


class EngineMetrics:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self.clock = clock  # the scheduler's
        self.queue_depth = 0
        self.running = 0
        # Of the running requests, after the last step: the beam rows decoding and the context tokens (prompt tokens,
        # history events) admitted. The work a step carries, which request counts alone do not show.
        self.beam_rows = 0
        self.context_tokens = 0
        self.kv_bytes_reserved = 0
        self.steps = 0
        self.step_started: float | None = None  # clock time the step in flight began; None between steps
        self.batch_rows_per_step = Histogram(SIZE_BUCKETS)
        self.prefill_tokens_per_step = Histogram(SIZE_BUCKETS)
        self.time_to_first_step: dict[str, Histogram] = defaultdict(Histogram)
        self.latency: dict[str, Histogram] = defaultdict(Histogram)
        self.requests: dict[tuple[str, str], int] = defaultdict(int)

    def finished(self, kind: str, status: str, seconds: float | None = None) -> None:
        with self._lock:
            self.requests[(kind, status)] += 1
            if seconds is not None and status == "ok":
                self.latency[kind].observe(seconds)

    def step_in_flight_s(self) -> float:
        """How long the step in flight has run (0 between steps)."""
        started = self.step_started
        return 0.0 if started is None else self.clock() - started

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "step_in_flight_s": self.step_in_flight_s(),
                "queue_depth": self.queue_depth,
                "running": self.running,
                "beam_rows": self.beam_rows,
                "context_tokens": self.context_tokens,
                "kv_bytes_reserved": self.kv_bytes_reserved,
                "steps": self.steps,
                "batch_rows_per_step": self.batch_rows_per_step.snapshot(),
                "prefill_tokens_per_step": self.prefill_tokens_per_step.snapshot(),
                "time_to_first_step": {k: h.snapshot() for k, h in self.time_to_first_step.items()},
                "latency": {k: h.snapshot() for k, h in self.latency.items()},
                "requests": {f"{k}:{s}": n for (k, s), n in self.requests.items()},
            }
