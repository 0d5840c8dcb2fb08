"""The prefix cache's stats reach the Prometheus exporter: the engine's cumulative totals become counter
increments (a counter only goes up), bytes held and entries gauges; so do the work in flight, the catalog version
served and the embedding cache's lookups. No Ray cluster: the metric classes are fakes."""

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
        self.series[tuple(sorted((tags or {}).items()))] = value


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


def recorded_exporter(monkeypatch) -> metrics.EngineMetricsExporter:
    for name in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics, name, Recorded)
    return metrics.EngineMetricsExporter()


def engine_snapshot(**fields) -> dict:
    """An engine metrics snapshot of an idle engine, with `fields` set."""
    quiet = {"p50": None}
    idle = {"queue_depth": 0, "running": 0, "kv_bytes_reserved": 0, "requests": {}}
    return idle | {"batch_rows_per_step": quiet, "prefill_tokens_per_step": quiet} | fields


def test_the_step_in_flight_is_exported(monkeypatch):
    exporter = recorded_exporter(monkeypatch)
    exporter.update(engine_snapshot(running=1, step_in_flight_s=42.5))
    assert exporter.step_in_flight.value == 42.5


def test_the_work_in_flight_and_the_catalog_served_are_exported(monkeypatch):
    """Beam rows and context tokens as the engine's snapshot has them, the work the autoscaling policy reads; the
    served catalog version as a tag, and none while a retriever refuses (its old version then stops being set, and
    Ray's agent drops it)."""
    exporter = recorded_exporter(monkeypatch)
    snapshot = engine_snapshot(running=2, beam_rows=24, context_tokens=300)
    exporter.update(snapshot, catalog="declared", catalog_version="c-1", work_in_flight=5000)
    assert (exporter.beam_rows.value, exporter.context_tokens.value, exporter.work.value) == (24, 300, 5000)
    assert exporter.catalog_version.series == {(("catalog_version", "c-1"),): 1}
    exporter.catalog_version.series.clear()
    exporter.update(snapshot, catalog="refusing", catalog_version=None)
    assert exporter.catalog_version.series == {}


def test_the_engine_counts_the_beam_rows_and_context_tokens_in_flight(engine):
    """Of the running requests, after each step: the rows of those decoding, the context tokens of all; 0 once
    they are done."""
    from genrec.api import RetrieveRequest
    from genrec.engine.scheduler import Scheduler

    scheduler = Scheduler(engine.family, engine.runner)
    prompt = [3 + i % 150 for i in range(40)]
    futures = [scheduler.submit(engine.prepare(RetrieveRequest(prompt_token_ids=prompt, beam_width=4)))]
    futures.append(scheduler.submit(engine.prepare(RetrieveRequest(prompt_token_ids=prompt[:10], beam_width=2))))
    seen = []
    while not scheduler.idle:
        scheduler.step()
        snapshot = scheduler.snapshot()
        seen.append((snapshot["running"], snapshot["beam_rows"], snapshot["context_tokens"]))
    assert all(f.done() for f in futures)
    assert (2, 6, 50) in seen  # both decoding, 4 and 2 beams wide: 6 rows, over 40 + 10 context tokens
    assert seen[-1] == (0, 0, 0)


def test_the_embedding_caches_lookups_become_counter_increments(monkeypatch):
    """Each shard's cumulative table stats, tagged with the cache's name and the shard; at 0 before any lookup."""
    from genrec.cache import metrics as cache_metrics
    from genrec.cache.table import TableStats

    monkeypatch.setattr(cache_metrics, "Counter", Recorded)
    exporter = cache_metrics.CacheMetrics("users", 1)
    tags = (("cache", "users"), ("shard", "1"))
    assert {name: c.series for name, c in exporter.counters.items()} == dict.fromkeys(exporter.counters, {tags: 0})
    exporter.update(TableStats(hits=3, misses=2, store_hits=1))
    exporter.update(TableStats(hits=3, misses=5, store_hits=1))  # what did not move adds nothing
    values = {name: c.series[tags] for name, c in exporter.counters.items()}
    assert values == {
        "genrec_embedding_cache_hits": 3,
        "genrec_embedding_cache_misses": 5,
        "genrec_embedding_cache_store_hits": 1,
    }


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
