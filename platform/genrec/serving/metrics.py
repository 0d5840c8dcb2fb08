"""Engine metrics exported through `ray.serve.metrics` (Prometheus at each node's metrics export port).

Per request (kind, status): a counter and a latency histogram. Every second, the engine loop's state:
queue depth, running requests, KV bytes reserved, and recent rows and prefill tokens per step.
"""

from __future__ import annotations

from ray.serve.metrics import Counter, Gauge, Histogram

from genrec.engine.metrics import LATENCY_BUCKETS


class EngineMetricsExporter:
    def __init__(self):
        self.requests = Counter("genrec_requests", description="finished engine requests", tag_keys=("kind", "status"))
        self.latency = Histogram(
            "genrec_request_latency_s",
            description="engine request latency, seconds",
            boundaries=list(LATENCY_BUCKETS),
            tag_keys=("kind",),
        )
        self.queue_depth = Gauge("genrec_queue_depth", description="requests waiting for admission")
        self.running = Gauge("genrec_running_requests", description="requests in prefill or decode")
        self.kv_bytes = Gauge("genrec_kv_bytes_reserved", description="KV memory reserved by running requests")
        self.rows_per_step = Gauge("genrec_rows_per_step_p50", description="median decode rows per step (recent)")
        self.prefill_per_step = Gauge(
            "genrec_prefill_tokens_per_step_p50", description="median prefill tokens per step (recent)"
        )
        self.model_load_seconds = Gauge("genrec_model_load_s", description="seconds this replica took to load")

    def finished(self, kind: str, status: str, seconds: float) -> None:
        self.requests.inc(tags={"kind": kind, "status": status})
        if status == "ok":
            self.latency.observe(seconds, tags={"kind": kind})

    def update(self, snapshot: dict) -> None:
        self.queue_depth.set(snapshot["queue_depth"])
        self.running.set(snapshot["running"])
        self.kv_bytes.set(snapshot["kv_bytes_reserved"])
        self.rows_per_step.set(snapshot["batch_rows_per_step"]["p50"] or 0)
        self.prefill_per_step.set(snapshot["prefill_tokens_per_step"]["p50"] or 0)
