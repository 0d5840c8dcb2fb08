"""The engine deployment: one AsyncEngine per replica, so concurrent requests meet in its batching loop."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import zlib
from collections.abc import Callable

from ray import serve
from ray.serve.exceptions import RayServeException

from genrec.engine import AsyncEngine, Engine
from genrec.serving.args import EngineLimits, ReplicaOptions, RetrieverLive, live_limits
from genrec.serving.autoscaling import WORK_METRIC
from genrec.serving.declared_catalog import DeclaredCatalog
from genrec.serving.http_errors import CatalogNotServed
from genrec.serving.metrics import EngineMetricsExporter
from genrec.serving.replicas import REPORT_EVERY_S, board
from genrec.serving.schemas import ModelInfo

log = logging.getLogger(__name__)


@serve.deployment(name="EngineServer", health_check_period_s=5, health_check_timeout_s=10)
class EngineServer:
    driver: AsyncEngine | None = None  # until __init__ builds it (Serve may call __del__ after a failed __init__)

    def __init__(
        self,
        model_dir: str,
        device: str,
        options: ReplicaOptions,
        limits: EngineLimits = EngineLimits(),
        driver_factory: Callable[..., AsyncEngine] | None = None,
    ):
        """`driver_factory(model_dir, device, options, limits)`: the replica's AsyncEngine (default: `load_driver`)."""
        # Before the model loads, so that torch's threads start on their cores.
        self.threads = options.apply(slot=_replica_slot())
        started = time.perf_counter()
        # The builder's limits until reconfigure applies the config's (and if the config's are refused).
        self.limits, self.config_refused = limits, None
        self.driver = (driver_factory or load_driver)(model_dir, device, options, limits)
        self.model_dir, self.device = model_dir, device
        self.info = describe(self.driver, model_dir, device)
        # A retriever's catalog converges on the file its user_config declares; a ranker has none to change.
        live = self.driver.live_catalog
        self.catalog = DeclaredCatalog(model_dir, self.driver.load_catalog, self._report) if live else None
        self.replica = _replica_id()
        self.metrics = EngineMetricsExporter(self.info.serves)
        self.metrics.load_s = time.perf_counter() - started
        self._stopped = threading.Event()
        threading.Thread(target=self._export_until_stopped, name="genrec-metrics", daemon=True).start()

    async def reconfigure(self, user_config: dict) -> None:
        """Live limits and a retriever's catalog from `user_config` (docs/serving.md, "Live changes"). A config that
        does not validate is refused and the running limits stay (args.live_limits)."""
        live_model = RetrieverLive if self.catalog is not None else EngineLimits
        live, self.config_refused = live_limits(live_model, user_config, self.limits)
        if self.config_refused is None:
            limits = live.limits() if isinstance(live, RetrieverLive) else live
            self.driver.reconfigure(**limits.model_dump())
            self.limits = limits
            if isinstance(live, RetrieverLive):
                await self.catalog.declare(live.catalog)
        elif self.catalog is not None and self.catalog.refusing:  # at start: the catalog it declares is unknown
            self.catalog.undeclare(f"the user_config was refused ({self.config_refused})")

    @property
    def catalog_status(self) -> str | None:
        """A retriever's schemas.CatalogStatus; None for a ranker."""
        return None if self.catalog is None else self.catalog.status

    def _check_serving(self) -> None:
        if self.catalog is not None and self.catalog.refusing:
            raise CatalogNotServed(self.catalog.declared, self.catalog.refused or "not loaded yet")

    # `routing_key` is read by the caller's request router (router.py), not here.
    async def retrieve(self, request, timeout_s: float, routing_key: str | None = None):
        return await self._run("retrieve", request, timeout_s)

    async def score(self, request, timeout_s: float, routing_key: str | None = None):
        return await self._run("score", request, timeout_s)

    async def recommend(self, request, timeout_s: float, routing_key: str | None = None):
        return await self._run("recommend", request, timeout_s)

    async def rank(self, request, timeout_s: float, routing_key: str | None = None):
        return await self._run("rank", request, timeout_s)

    async def render_prompt(self, request, timeout_s: float, routing_key: str | None = None):
        """POST /v1/prompt. Not queued (no compute); in a worker thread: this loop also answers health checks."""
        return await asyncio.to_thread(self.driver.render_prompt, request), self.info.version

    def model_info(self, routing_key: str | None = None) -> ModelInfo:
        """The model, and the catalog this replica serves now (its levels and codes too; none while refusing)."""
        served = describe(self.driver, self.model_dir, self.device)  # its catalog fields: the served one's
        return served.model_copy(update={"replica": self.replica, **self._catalog_state()})

    def _catalog_state(self) -> dict:
        """What this replica reports to the app's board; a refusing replica serves no catalog version."""
        state = {"replica": self.replica, "catalog_refused": None}
        if self.catalog is not None:
            catalog = self.catalog
            state |= self.driver.catalog_state()
            state |= {"catalog_refused": catalog.refused, "catalog_declared": catalog.declared}
            state |= {"catalog_status": catalog.status, "catalog_not_declared_since": catalog.not_declared_since}
            if catalog.refusing:
                state |= {"catalog_version": None, "previous_catalog_version": None, "catalog_items": 0}
        return state

    def _served_catalog_version(self) -> str | None:
        """The catalog version requests are answered from: a ranker's never changes; a retriever's may change live,
        and while it refuses for want of its declared catalog it serves none (None)."""
        if self.catalog is None:
            return self.info.catalog_version
        return None if self.catalog.refusing else self.driver.catalog_state()["catalog_version"]

    def record_routing_stats(self) -> dict:
        """Serve's routing stats, read by router.py: a replica refusing for want of its catalog is tried last."""
        return {"catalog_served": self.catalog is None or not self.catalog.refusing}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaling stats: the work queued and running in this replica's engine, which genrec's policy
        scales on (genrec.serving.autoscaling). A running sum: cheap on the replica's event loop."""
        return {WORK_METRIC: float(self.driver.work_in_flight)}

    def _report(self) -> None:
        """This replica's catalog state to the app's board (GET /v1/model); no board outside Serve."""
        try:
            context = serve.get_replica_context()
        except RayServeException:
            return
        try:  # looked up each time: a board left idle ends itself (replicas.py) and a new one takes its name
            board(context.app_name).report.remote(context.deployment, self.replica, self._catalog_state())
        except Exception as err:  # noqa: BLE001 - the board is a view: never fail the replica for it
            log.warning("genrec: the replica board is unreachable (%s)", err)

    def stats(self, routing_key: str | None = None) -> dict:
        """For benches and tests, through a handle (a random routing key reaches each replica)."""
        return {
            "replica": self.replica,
            "metrics": self.driver.metrics(),
            "work_in_flight": self.driver.work_in_flight,
            "limits": self.limits.model_dump(),
            "user_config_refused": self.config_refused,
            "threads": self.threads.as_dict(),
        }

    def check_health(self) -> None:
        if not self.driver.healthy:
            raise RuntimeError("the engine loop is not running")

    def __del__(self):  # Serve calls this after draining the replica's ongoing requests
        if self.driver is not None:
            self._stopped.set()
            self.driver.shutdown(timeout_s=5.0, drain=True)

    async def _run(self, kind: str, request, timeout_s: float):
        """The result; the engine counts its outcome, and this counts a catalog refusal."""
        started = time.perf_counter()
        try:
            self._check_serving()
        except CatalogNotServed as err:
            self.driver.refused(kind, err)
            raise
        # Validation and tokenizing run in a worker thread: this event loop also answers health checks.
        future = await asyncio.to_thread(self.driver.submit, request, timeout_s, kind)
        result = await asyncio.wrap_future(future)  # cancelling this cancels the request in the engine
        self.metrics.answered(kind, time.perf_counter() - started)
        return result, self.info.version

    def _export_until_stopped(self, period_s: float = 1.0) -> None:
        ticks = 0
        while not self._stopped.wait(period_s):
            since = None if self.catalog is None else self.catalog.not_declared_since
            status, refused = self.catalog_status, self.config_refused is not None
            self.metrics.update(
                self.driver.metrics(),
                config_refused=refused,
                catalog=status,
                not_declared_since=since,
                catalog_version=self._served_catalog_version(),
                work_in_flight=self.driver.work_in_flight,
            )
            if ticks % int(REPORT_EVERY_S / period_s) == 0:
                self._report()
            ticks += 1


def load_driver(model_dir: str, device: str, options: ReplicaOptions, limits: EngineLimits) -> AsyncEngine:
    """The replica's AsyncEngine over the model directory."""
    scheduler = options.scheduler_config(limits)
    return AsyncEngine(Engine.from_pretrained(model_dir, device=device, scheduler=scheduler, **options.engine_kwargs()))


def describe(driver: AsyncEngine | Engine, model_dir: str, device: str) -> ModelInfo:
    """What /v1/model says about the engine's model (the other family's fields None)."""
    return ModelInfo(model_dir=str(model_dir), device=device, **driver.describe())


def _replica_id() -> str:
    """Serve's unique ID of this replica (what the request router hashes); "local" outside Serve (tests)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:
        return "local"


def _replica_slot() -> int | None:
    """Where pinned cores start: from the Serve ID, so replicas on one node differ (None outside Serve)."""
    try:
        unique = serve.get_replica_context().replica_id.unique_id
    except RayServeException:
        return None
    return zlib.crc32(unique.encode())
