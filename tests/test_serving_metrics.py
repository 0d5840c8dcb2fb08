"""The prefix cache's stats reach the Prometheus exporter: the engine's cumulative totals become counter
increments (a counter only goes up), bytes held and entries gauges. No Ray cluster: the metric classes are fakes."""

import asyncio
import concurrent.futures

from genrec.engine.metrics import OUTCOMES, outcome_of
from genrec.errors import EngineStopped, InvalidRequestError, Overloaded, RequestTimeout
from genrec.serving import metrics
from genrec.serving.http_errors import CatalogNotServed, NotServed


class Recorded:
    def __init__(self, name, description="", **_):
        self.name, self.value = name, 0
        self.series: dict[tuple, float] = {}  # what the exporter would publish: tags -> value

    def inc(self, value=1.0, tags=None):
        assert value > 0  # as ray.util.metrics.Counter requires
        self.value += value
        self._record(value, tags)

    def _record(self, value, tags=None):
        key = tuple(sorted((tags or {}).items()))
        self.series[key] = self.series.get(key, 0) + value

    def set(self, value, tags=None):
        self.value = value


def test_prefix_cache_totals_become_counter_increments_and_gauges(monkeypatch):
    monkeypatch.setattr(metrics, "Counter", Recorded)
    monkeypatch.setattr(metrics, "Gauge", Recorded)
    exporter = metrics.PrefixCacheExporter()
    stats = {"tokens_reused": 0, "tokens_prompted": 120, "hits": 0, "evictions": 0, "spills": 0}
    exporter.update({**stats, "bytes_held": 4096, "entries": 1})
    exporter.update({**stats, "tokens_reused": 96, "tokens_prompted": 250, "hits": 1, "bytes_held": 8192, "entries": 2})
    exporter.update({**stats, "tokens_reused": 96, "tokens_prompted": 250, "hits": 1, "evictions": 1, "entries": 1})
    values = {name: c.value for name, c in {**exporter.counters, **exporter.gauges}.items()}
    assert values == {
        "genrec_prefix_cache_tokens_reused": 96,
        "genrec_prefix_cache_tokens_prompted": 250,
        "genrec_prefix_cache_hits": 1,
        "genrec_prefix_cache_evictions": 1,
        "genrec_prefix_cache_spills": 0,
        "genrec_prefix_cache_bytes_held": 0,
        "genrec_prefix_cache_entries": 1,
    }


def test_the_engine_snapshot_feeds_the_prefix_cache_exporter(monkeypatch, tiny_dir):
    import asyncio

    from genrec.api import RetrieveRequest
    from genrec.engine import AsyncEngine, Engine

    for name in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics, name, Recorded)
    exporter = metrics.EngineMetricsExporter()
    engine = AsyncEngine(Engine.from_pretrained(tiny_dir))  # the prefix cache on, as in a replica
    try:
        prompt = [3 + i % 150 for i in range(100)]
        request = RetrieveRequest(prompt_token_ids=prompt, beam_width=4, cache_scope="user-1")  # a returning user
        for _ in range(2):
            asyncio.run(engine.retrieve(request))
        exporter.load_s = 1.5
        exporter.update(engine.metrics(), config_refused=True)
    finally:
        engine.shutdown()
    # Every gauge is set at each update: Ray's agent drops a gauge series left unset for two export intervals.
    assert (exporter.model_load_seconds.value, exporter.user_config_refused.value) == (1.5, 1)
    counters = exporter.prefix_cache.counters
    assert counters["genrec_prefix_cache_tokens_prompted"].value == 200
    assert counters["genrec_prefix_cache_tokens_reused"].value >= 96
    assert counters["genrec_prefix_cache_hits"].value == 1
    assert exporter.prefix_cache.gauges["genrec_prefix_cache_bytes_held"].value > 0


def test_the_step_in_flight_is_exported(monkeypatch):
    for name in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics, name, Recorded)
    exporter = metrics.EngineMetricsExporter()
    snapshot = {
        "queue_depth": 0,
        "running": 1,
        "kv_bytes_reserved": 0,
        "batch_rows_per_step": {"p50": None},
        "prefill_tokens_per_step": {"p50": None},
        "step_in_flight_s": 42.5,
        "requests": {},
    }
    exporter.update(snapshot)
    assert exporter.step_in_flight.value == 42.5


def test_the_engines_counters_start_at_zero(monkeypatch):
    """Before anything happens, every kind served with every status, and every prefix-cache counter, is
    published at 0; the first request then moves its own series only."""
    for name in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics, name, Recorded)
    exporter = metrics.EngineMetricsExporter(["retrieve", "score"])
    series = exporter.requests.series
    expected = {(("kind", k), ("status", s)) for k in ("retrieve", "score") for s in OUTCOMES}
    assert set(series) == expected and set(series.values()) == {0}
    assert all(c.series == {(): 0} for c in exporter.prefix_cache.counters.values())
    exporter.export_outcomes({"score:timeout": 1})
    assert {key: n for key, n in series.items() if n} == {(("kind", "score"), ("status", "timeout")): 1}


def test_the_exported_outcomes_move_by_what_the_engines_count_moved(monkeypatch):
    """The replica exports the engine's one outcome count: each export adds what moved since the last, once."""
    monkeypatch.setattr(metrics, "Counter", Recorded)
    exporter = metrics.EngineMetricsExporter()
    series = exporter.requests.series
    exporter.export_outcomes({"retrieve:ok": 3, "retrieve:invalid": 1})
    exporter.export_outcomes({"retrieve:ok": 3, "retrieve:invalid": 1})  # nothing moved: nothing added
    exporter.export_outcomes({"retrieve:ok": 5, "retrieve:invalid": 1, "score:overloaded": 2})
    counted = {dict(key)["kind"] + ":" + dict(key)["status"]: n for key, n in series.items() if n}
    assert counted == {"retrieve:ok": 5, "retrieve:invalid": 1, "score:overloaded": 2}


def test_every_way_a_request_ends_has_its_outcome():
    """A failed request is counted by outcome_of (the engine's, the replica's refusals); each starts at 0 above."""
    ends = {
        asyncio.CancelledError(): "cancelled",
        concurrent.futures.CancelledError(): "cancelled",
        InvalidRequestError("beam_width", "too wide"): "invalid",
        NotServed("rank", "qwen3", ["retrieve"]): "invalid",
        Overloaded("engine queue is full"): "overloaded",
        RequestTimeout("late"): "timeout",
        EngineStopped("stopped"): "stopped",
        CatalogNotServed("/m/catalog-1.parquet", "catalog file is missing"): "catalog_not_served",
        RuntimeError("a bug"): "error",
    }
    assert [outcome_of(err) for err in ends] == list(ends.values())
    assert set(ends.values()) | {"ok"} == set(OUTCOMES)
