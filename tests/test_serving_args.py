"""The Serve app's arguments reach the engine: build-time options as Engine kwargs and a SchedulerConfig, live
limits through `reconfigure` (a limit the config no longer names reverts to its default). No Ray cluster."""

import asyncio

import numpy as np
import pytest
from pydantic import ValidationError

from genrec.cache.config import CacheConfig
from genrec.engine import AsyncEngine, SchedulerConfig
from genrec.model.directory import model_version
from genrec.serving import engine_server
from genrec.serving.args import AppArgs, EngineLimits, IngressLimits, live_limits

OPTIONS = {
    "dtype": "bfloat16",
    "max_candidates": 64,
    "score_max_tokens": 1024,
    "max_candidate_tokens": 65536,
    "cuda_fast": True,
    "kv_budget_bytes": 1 << 20,
    "prefix_cache_bytes": 0,
    "host_cache_bytes": 1 << 16,
    "threads": 1,
}


def test_engine_options_become_engine_kwargs_and_a_scheduler_config():
    options = AppArgs(retriever={"model_dir": "/m", **OPTIONS}).retriever.replica_options()
    assert options.engine_kwargs() == {
        "dtype": "bfloat16",
        "max_candidates": 64,
        "score_max_tokens": 1024,
        "max_candidate_tokens": 65536,
        "cuda_fast": True,
    }
    config = options.scheduler_config(EngineLimits(max_queue=7))
    assert isinstance(config, SchedulerConfig)
    assert (config.kv_budget_bytes, config.prefix_cache_bytes, config.max_queue) == (1 << 20, 0, 7)
    assert config.host_cache_bytes == 1 << 16


def test_defaults_are_the_engines():
    options = AppArgs(retriever={"model_dir": "/m"}).retriever.replica_options()
    assert options.engine_kwargs() == {
        "dtype": None,
        "max_candidates": 2048,
        "score_max_tokens": 16384,
        "max_candidate_tokens": 65536,
    }  # cuda_fast, cuda_graph_max_rows and split_kv: derived (the fast path on with CUDA; 2048 rows; auto)
    assert options.scheduler_config() == SchedulerConfig()


@pytest.mark.parametrize(
    "field, value",
    [
        ("kv_budget_bytes", 0),
        ("prefix_cache_bytes", -1),
        ("host_cache_bytes", -1),
        ("score_max_tokens", 0),
        ("max_candidates", 0),
        ("dtype", "float64"),
        ("threads", 0),
        ("cuda_fast", "sometimes"),
        ("kv_budget", 1),
        ("cuda_graph_selection", True),  # removed: refused naming it
        ("split_kv", "sometimes"),
    ],
)
def test_a_bad_engine_option_is_refused_by_name(field, value):
    with pytest.raises(ValidationError, match=field):
        AppArgs(retriever={"model_dir": "/m", field: value})


def test_fp8_is_a_retrievers_option_and_a_ranker_refuses_it():
    assert AppArgs(retriever={"model_dir": "/m", "fp8": True}).retriever.replica_options().engine_kwargs()["fp8"]
    for name, value in {"fp8": True, "split_kv": "auto", "attention": "cudnn_attention"}.items():
        with pytest.raises(ValidationError, match=rf"ranker\n.*{name} is a Qwen3 decoder's option, and a ranker is"):
            AppArgs(retriever={"model_dir": "/m"}, ranker={"model_dir": "/r", name: value})


def test_a_cache_without_dim_is_refused():
    with pytest.raises(ValidationError, match="cache.dim is required"):
        AppArgs(retriever={"model_dir": "/m"}, ingress={"cache": {"name": "users"}})


@pytest.mark.parametrize(
    "section, field, value",
    [
        ("retriever", "max_candidates", True),  # lax pydantic took it as 1: every score request refused
        ("retriever", "kv_budget_bytes", "1048576"),
        ("retriever", "cuda_graph_max_rows", 64.0),
        ("retriever", "fp8", 1),
        ("retriever", "cuda_fast", "yes"),
        ("ingress", "retry_after_s", True),
        ("ingress", "body_timeout_s", False),
        ("ingress", "funnel_reserve_s", "1.5"),
        ("ingress", "deployment", {"graceful_shutdown_timeout_s": "40"}),  # compared with the deadline: a TypeError
        ("ingress", "deployment", {"graceful_shutdown_timeout_s": True}),
    ],
)
def test_a_number_or_a_switch_of_another_type_is_refused_by_name(section, field, value):
    """As a request's fields are: no bool where a number is, no number or text where a bool is (YAML's `true` and
    `256` are native; a quoted one was a slip)."""
    args = {"retriever": {"model_dir": "/m"}}
    args[section] = args.get(section, {}) | {field: value}
    with pytest.raises(ValidationError, match=field if field != "deployment" else "graceful_shutdown_timeout_s: a num"):
        AppArgs(**args)
    assert AppArgs(ingress={"body_timeout_s": 5, "funnel_reserve_s": 1}, retriever={"model_dir": "/m"})  # int: a float


def test_a_cache_count_of_another_type_is_refused_by_name():
    with pytest.raises(ValidationError, match="capacity"):
        CacheConfig(name="users", dim=4, capacity=True)
    assert CacheConfig(name="users", dim=4, capacity=10).capacity == 10


def test_numpy_scalars_are_taken_by_their_values():
    args = AppArgs(retriever={"model_dir": "/m", "max_candidates": np.int64(64), "fp8": np.bool_(False)})
    assert (args.retriever.max_candidates, args.retriever.fp8) == (64, False)
    assert EngineLimits(max_queue=np.int32(5)).max_queue == 5


@pytest.mark.parametrize("model, field", [(EngineLimits, "max_queue"), (IngressLimits, "request_timeout_s")])
def test_a_live_limit_of_another_type_is_refused_and_the_running_ones_stay(model, field):
    running = model()
    for value in (True, "8"):
        kept, refused = live_limits(model, {field: value}, running)
        assert kept is running and field in refused


class RecordingEngine:
    """A driver factory standing in for the replica's AsyncEngine: records what EngineServer builds it with (the
    Engine's keyword arguments and its SchedulerConfig), what it sets live and the refusals it is told to count."""

    def __init__(self, tiny):
        self.engine, self.built, self.config, self.live, self.refusals = tiny, None, None, [], []
        self.loaded = []  # the catalog files it was asked to load

    def __call__(self, model_dir, device, options, limits):
        self.built = {"device": device, **options.engine_kwargs()}
        self.config = options.scheduler_config(limits)
        return self

    def reconfigure(self, **fields):
        self.live.append(fields)

    def load_catalog(self, path):
        self.loaded.append(path)
        return self.engine.load_catalog(path)

    # What the replica reads of its driver besides requests: the AsyncEngine's own, over the recorded engine.
    live_catalog = property(lambda self: self.engine.live_catalog)
    catalog_state = AsyncEngine.catalog_state

    def describe(self):
        return self.engine.describe()

    def refused(self, kind, err):
        self.refusals.append((kind, type(err).__name__))

    def metrics(self):
        return {}

    work_in_flight = 0  # what the replica reports to Serve's autoscaler: nothing runs in a recording

    def shutdown(self, **_):
        pass


class QuietMetrics:
    def __init__(self, kinds=()):
        self.kinds = list(kinds)

    def update(self, _, **__):
        pass

    def finished(self, *_):
        pass


def reconfigure(server, user_config: dict) -> None:
    """What Serve does with a deployment's user_config: awaits the replica's (async) reconfigure."""
    asyncio.run(server.reconfigure(user_config))


@pytest.fixture
def recorded(monkeypatch, engine):
    monkeypatch.setattr(engine_server, "EngineMetricsExporter", QuietMetrics)
    return RecordingEngine(engine)


def test_engine_server_builds_the_engine_with_the_options(recorded, tiny_dir):
    args = AppArgs(retriever={"model_dir": str(tiny_dir), **OPTIONS}).retriever
    server = engine_server.EngineServer.func_or_class(
        args.model_dir, args.device, args.replica_options(), driver_factory=recorded
    )
    try:
        assert recorded.built == {"device": "cpu", **args.replica_options().engine_kwargs()}
        assert (recorded.config.kv_budget_bytes, recorded.config.prefix_cache_bytes) == (1 << 20, 0)
        assert server.info.version == model_version(tiny_dir)
    finally:
        server._stopped.set()


def test_reconfigure_sets_every_limit_and_a_removed_one_reverts(recorded, tiny_dir):
    options = AppArgs(retriever={"model_dir": "/m"}).retriever.replica_options()
    server = engine_server.EngineServer.func_or_class(str(tiny_dir), "cpu", options, driver_factory=recorded)
    try:
        reconfigure(server, {"max_queue": 5, "max_running": 2})
        reconfigure(server, {"max_running": 2})  # max_queue removed from the config's user_config
        reconfigure(server, {})
        defaults = EngineLimits().model_dump()
        assert recorded.live == [
            {**defaults, "max_queue": 5, "max_running": 2},
            {**defaults, "max_running": 2},
            defaults,
        ]
    finally:
        server._stopped.set()


def test_a_user_config_that_does_not_validate_keeps_the_running_limits(recorded, tiny_dir):
    """Raising from reconfigure would make Serve tear the replica down (and its replacements fail alike): a bad
    user_config is refused, the limits in force stay, and the replica says why. At start, the builder's limits
    are in force."""
    options = AppArgs(retriever={"model_dir": "/m"}).retriever.replica_options()
    server = engine_server.EngineServer.func_or_class(
        str(tiny_dir), "cpu", options, EngineLimits(max_queue=9), driver_factory=recorded
    )
    try:
        assert recorded.config.max_queue == 9
        reconfigure(server, {"max_queue": 0})  # the first user_config, at start: the builder's limits stay
        assert recorded.live == [] and server.limits.max_queue == 9
        reconfigure(server, {"max_queue": 5})
        assert server.stats()["user_config_refused"] is None
        reconfigure(server, {"max_queue": 5, "max_running": "many", "queue": 1})
        assert recorded.live == [{**EngineLimits().model_dump(), "max_queue": 5}]
        stats = server.stats()
        assert stats["limits"] == {**EngineLimits().model_dump(), "max_queue": 5}
        assert "max_running" in stats["user_config_refused"] and "queue" in stats["user_config_refused"]
    finally:
        server._stopped.set()


def test_a_catalog_the_replica_cannot_load_is_refused_and_a_rewritten_file_is_loaded_again(
    monkeypatch, tiny_dir, tmp_path
):
    """Whatever goes wrong with a user_config's catalog (an unknown ~user, a missing file) is a refusal the replica
    reports while it keeps serving; naming a file is loading what it holds now (rewritten in place: loaded)."""
    import numpy as np

    from genrec.catalog import Catalog
    from genrec.engine import Engine

    fresh = Engine.from_pretrained(tiny_dir, scheduler=SchedulerConfig(prefix_cache_bytes=0))
    monkeypatch.setattr(engine_server, "EngineMetricsExporter", QuietMetrics)
    options = AppArgs(retriever={"model_dir": "/m"}).retriever.replica_options()
    server = engine_server.EngineServer.func_or_class(
        str(tiny_dir), "cpu", options, driver_factory=RecordingEngine(fresh)
    )
    try:
        original = fresh.catalog
        reconfigure(server, {})  # at start: the model's own catalog, declared
        for bad in ("~no-such-user-genrec/c.parquet", str(tmp_path / "missing.parquet")):
            reconfigure(server, {"catalog": bad})  # live changes: refused, the running catalog stays
            info = server.model_info()
            assert info.catalog_refused and info.catalog_version == original.version, bad
            assert info.catalog_status == "kept_running" and server.record_routing_stats()["catalog_served"]
        path = tmp_path / "next.parquet"
        for step in (2, 3):  # the same path, rewritten in place between two deploys of the same config
            rows = np.arange(0, len(original), step)
            Catalog(original.item_ids[rows], original.codes[rows], original.lengths[rows]).save(path)
            reconfigure(server, {"catalog": str(path)})
            info = server.model_info()
            assert info.catalog_refused is None and info.catalog_items == len(rows)
        reconfigure(server, {})  # the catalog removed from the config: the model's own again
        assert server.model_info().catalog_version == original.version
    finally:
        server._stopped.set()


def test_a_replica_that_cannot_load_its_declared_catalog_at_start_refuses_until_it_can(monkeypatch, tiny_dir, tmp_path):
    """A replica started (or restarted) with a catalog it cannot load serves no other (not the model's own, loaded
    first): every request is a CatalogNotServed naming the file, its routing stats and /v1/model say so; once the
    file is there it loads it without a reconfigure (Serve sends none for an unchanged config); then a live change
    it cannot load keeps the running catalog."""
    import numpy as np

    from genrec.api import RecommendRequest, RetrieveRequest
    from genrec.catalog import Catalog
    from genrec.catalog.catalog import catalog_version
    from genrec.engine import Engine
    from genrec.serving.http_errors import CatalogNotServed

    fresh = Engine.from_pretrained(tiny_dir, scheduler=SchedulerConfig(prefix_cache_bytes=0))
    monkeypatch.setattr(engine_server, "EngineMetricsExporter", QuietMetrics)
    options = AppArgs(retriever={"model_dir": "/m"}).retriever.replica_options()
    server = engine_server.EngineServer.func_or_class(
        str(tiny_dir), "cpu", options, driver_factory=RecordingEngine(fresh)
    )
    declared = tmp_path / "retired.parquet"
    try:
        reconfigure(server, {"catalog": str(declared)})  # at start: the file is gone
        info = server.model_info()
        assert (info.catalog_status, info.catalog_declared, info.catalog_version) == ("refusing", str(declared), None)
        assert "retired.parquet" in info.catalog_refused and info.catalog_items == 0
        assert server.record_routing_stats() == {"catalog_served": False}
        request = RetrieveRequest(prompt_token_ids=[3, 4, 5], beam_width=2)
        stage1 = RecommendRequest(prompt_token_ids=[3, 4, 5], beam_width=2, rank_by="beam")  # a funnel's stage 1
        for call, asked in ((server.retrieve, request), (server.recommend, stage1)):
            with pytest.raises(CatalogNotServed, match=f"catalog not served: {declared}"):
                asyncio.run(call(asked, 10.0))
        # each refusal counted once, by the engine's one outcome count
        assert server.driver.refusals == [("retrieve", "CatalogNotServed"), ("recommend", "CatalogNotServed")]

        assert not asyncio.run(server.catalog.check())  # still missing: nothing tried
        original = fresh.catalog
        rows = np.arange(0, len(original), 2)
        Catalog(original.item_ids[rows], original.codes[rows], original.lengths[rows]).save(declared)
        assert asyncio.run(server.catalog.check())  # the watcher's next check loads it (no reconfigure)
        info = server.model_info()
        assert (info.catalog_status, info.catalog_version) == ("declared", catalog_version(declared))
        assert server.record_routing_stats() == {"catalog_served": True}
        reconfigure(server, {"catalog": str(tmp_path / "missing.parquet")})  # a live change: the running one stays
        info = server.model_info()
        assert (info.catalog_status, info.catalog_version) == ("kept_running", catalog_version(declared))
    finally:
        server._stopped.set()


def test_a_replica_not_serving_its_declared_catalog_converges_on_it(monkeypatch, tiny_dir, tmp_path):
    """Whatever keeps a replica off its declared file (not there yet, being written, rewritten in place with
    other items), each check after the file changes loads it once it is valid; one that has not changed is not
    read again; /v1/model says since when the replica has not served it."""
    import time

    import numpy as np

    from genrec.catalog import Catalog
    from genrec.catalog.catalog import catalog_version
    from genrec.engine import Engine

    fresh = Engine.from_pretrained(tiny_dir, scheduler=SchedulerConfig(prefix_cache_bytes=0))
    monkeypatch.setattr(engine_server, "EngineMetricsExporter", QuietMetrics)
    options = AppArgs(retriever={"model_dir": "/m"}).retriever.replica_options()
    driver = RecordingEngine(fresh)
    server = engine_server.EngineServer.func_or_class(str(tiny_dir), "cpu", options, driver_factory=driver)
    original = fresh.catalog

    def save(step: int, path):
        rows = np.arange(0, len(original), step)
        Catalog(original.item_ids[rows], original.codes[rows], original.lengths[rows]).save(path)
        return catalog_version(path)

    def state():
        info = server.model_info()
        return info.catalog_status, info.catalog_version, info.catalog_not_declared_since

    declared = tmp_path / "arriving.parquet"
    try:
        reconfigure(server, {})
        assert state() == ("declared", original.version, None)
        before = time.time()
        reconfigure(server, {"catalog": str(declared)})  # a live change to a file not there yet
        status, version, since = state()
        assert (status, version) == ("kept_running", original.version) and before <= since <= time.time()
        loads = len(driver.loaded)
        assert not asyncio.run(server.catalog.check()) and len(driver.loaded) == loads  # nothing there: no read
        declared.write_bytes(b"PAR1 half a copy")  # the copy in flight: tried, refused, the running one stays
        assert asyncio.run(server.catalog.check()) and state() == ("kept_running", original.version, since)
        assert not asyncio.run(server.catalog.check())  # unchanged since: not read again
        arrived = save(2, declared)
        assert asyncio.run(server.catalog.check()) and state() == ("declared", arrived, None)
        assert not asyncio.run(server.catalog.check())

        rewritten = save(3, declared)  # in place, other items: converges by its content hash
        assert rewritten != arrived
        assert asyncio.run(server.catalog.check()) and state() == ("declared", rewritten, None)
        assert set(fresh.catalog.item_ids.tolist()) == set(original.item_ids[::3].tolist())
        touched = declared.read_bytes()
        declared.write_bytes(touched)  # the same content written again: checked, nothing swapped
        assert asyncio.run(server.catalog.check()) and server.model_info().previous_catalog_version == arrived
    finally:
        server._stopped.set()


def test_a_ranker_that_scales_to_zero_is_never_answered_for_want_of_a_replica(monkeypatch):
    """Idle at zero replicas, the ranker's request must reach Serve's handle (which starts one): the ingress's
    fail-fast check lets it through; a ranker that keeps a replica, with none running, is answered at once."""
    from types import SimpleNamespace

    from genrec.serving import replicas
    from genrec.serving.http_errors import EngineUnavailable
    from genrec.serving.ingress import Ingress

    base = {"model_dir": "m", "deployment": {"autoscaling_config": {"min_replicas": 0, "max_replicas": 2}}}
    scaling = AppArgs.model_validate({"retriever": {"model_dir": "r"}, "ranker": base})
    assert scaling.ranker.scales_to_zero() and not scaling.retriever.scales_to_zero()
    fixed = AppArgs.model_validate({"ranker": base | {"deployment": {"num_replicas": 1}}})
    assert not fixed.ranker.scales_to_zero()

    monkeypatch.setitem(replicas._LIVE, ("app", "RankerServer"), frozenset())  # the router knows none running
    handle = SimpleNamespace(app_name="app", deployment_name="RankerServer")
    check = Ingress.func_or_class._check_running
    check(SimpleNamespace(handles={"ranker": handle}, idle_at_zero=frozenset({"ranker"})), "ranker")
    with pytest.raises(EngineUnavailable, match="none is running"):
        check(SimpleNamespace(handles={"ranker": handle}, idle_at_zero=frozenset()), "ranker")
