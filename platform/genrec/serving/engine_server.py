"""The engine deployment: one AsyncEngine per replica, so concurrent requests meet in its batching loop."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable

from ray import serve
from ray.serve.exceptions import RayServeException

from genrec.engine import AsyncEngine, Engine
from genrec.errors import GenrecError
from genrec.serving.args import EngineLimits, ReplicaOptions, RetrieverLive, catalog_file, live_limits
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
        self.engine: Engine = self.driver.engine
        self.model_dir, self.device = model_dir, device
        self.info = describe(self.engine, model_dir, device)
        self.catalog_refused = None  # why the last catalog the user_config named was refused
        # A retriever refuses requests until it serves its declared catalog, never the model's own (`_serve_catalog`).
        self.declared: str | None = None
        self.refusing = self.engine.live_catalog
        self._catalog_lock = asyncio.Lock()
        self._retry: asyncio.Task | None = None
        self.replica = _replica_id()
        self._board = None
        self.metrics = EngineMetricsExporter(self.info.serves)
        self.metrics.load_s = time.perf_counter() - started
        self._stopped = threading.Event()
        threading.Thread(target=self._export_until_stopped, name="genrec-metrics", daemon=True).start()

    async def reconfigure(self, user_config: dict) -> None:
        """Live limits and a retriever's catalog from `user_config` (docs/serving.md, "Live changes"). A config that
        does not validate is refused and the running limits stay (args.live_limits)."""
        live_model = RetrieverLive if self.engine.live_catalog else EngineLimits
        live, self.config_refused = live_limits(live_model, user_config, self.limits)
        if self.config_refused is None:
            limits = live.limits() if isinstance(live, RetrieverLive) else live
            self.driver.reconfigure(**limits.model_dump())
            self.limits = limits
            if isinstance(live, RetrieverLive):
                await self._serve_catalog(live.catalog)
                if self.refusing and (self._retry is None or self._retry.done()):
                    self._retry = asyncio.create_task(self._retry_declared())
        elif self.refusing:  # at start: the catalog it declares is unknown, so none is served
            self.catalog_refused = f"the user_config was refused ({self.config_refused})"
            self._report()

    async def _serve_catalog(self, catalog: str | None) -> None:
        """Load the catalog the user_config names (skipped when its file's hash is the served version's). A failure
        never raises (Serve would tear the replica down, and its replacements fail alike): on a live change the
        running catalog stays (`kept_running`); at start the replica refuses requests (`refusing`) rather than
        serve the model's own catalog, whose items the config may have retired."""
        async with self._catalog_lock:  # a retry (`_retry_declared`) and a reconfigure never load at once
            self.declared = catalog  # as the config names it, until resolved (e.g. an unknown ~user is not)
            try:
                path = catalog_file(self.model_dir, catalog)
                self.declared = str(path)
                await asyncio.to_thread(self.driver.load_catalog, path)
                self.catalog_refused, self.refusing = None, False
                log.info("genrec: serving catalog %s (%s)", path, self.engine.catalog.version)
            except Exception as err:  # noqa: BLE001 - see above
                self.catalog_refused = str(err) if isinstance(err, GenrecError) else f"{catalog}: {err!r}"
                stays = "requests are refused" if self.refusing else "the running one stays"
                log.error("genrec: catalog %s refused, %s: %s", catalog, stays, self.catalog_refused)
        self._report()

    async def _retry_declared(self, period_s: float = REPORT_EVERY_S) -> None:
        """While refusing: load the declared catalog again once its file changes (Serve sends no reconfigure)."""
        seen = _file_state(self.declared)
        while self.refusing:
            await asyncio.sleep(period_s)
            if (now := _file_state(self.declared)) != seen and now is not None:
                seen = now
                await self._serve_catalog(self.declared)  # a resolved path names the same file again

    @property
    def catalog_status(self) -> str | None:
        """A retriever's schemas.CatalogStatus; None for a ranker."""
        if not self.engine.live_catalog:
            return None
        if self.refusing:
            return "refusing"
        return "kept_running" if self.catalog_refused is not None else "declared"

    def _check_serving(self) -> None:
        if self.refusing:
            raise CatalogNotServed(self.declared, self.catalog_refused or "not loaded yet")

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
        served = describe(self.engine, self.model_dir, self.device)  # its catalog fields: the served one's
        return served.model_copy(update={"replica": self.replica, **self._catalog_state()})

    def _catalog_state(self) -> dict:
        """What this replica reports to the app's board; a refusing replica serves no catalog version."""
        state = {"replica": self.replica, "catalog_refused": self.catalog_refused}
        if self.engine.live_catalog:
            state |= self.engine.catalog_state() | {"catalog_items": len(self.engine.catalog)}
            state |= {"catalog_declared": self.declared, "catalog_status": self.catalog_status}
            if self.refusing:
                state |= {"catalog_version": None, "previous_catalog_version": None, "catalog_items": 0}
        return state

    def record_routing_stats(self) -> dict:
        """Serve's routing stats, read by router.py: a replica refusing for want of its catalog is tried last."""
        return {"catalog_served": not self.refusing}

    def _report(self) -> None:
        """This replica's catalog state to the app's board (GET /v1/model); no board outside Serve."""
        try:
            context = serve.get_replica_context()
        except RayServeException:
            return
        try:
            if self._board is None:
                self._board = board(context.app_name)
            self._board.report.remote(context.deployment, self.replica, self._catalog_state())
        except Exception as err:  # noqa: BLE001 - the board is a view: never fail the replica for it
            log.warning("genrec: the replica board is unreachable (%s)", err)
            self._board = None

    def stats(self, routing_key: str | None = None) -> dict:
        """For benches and tests, through a handle (a random routing key reaches each replica)."""
        return {
            "replica": self.replica,
            "metrics": self.driver.metrics(),
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
            status = self.catalog_status
            self.metrics.update(self.driver.metrics(), config_refused=self.config_refused is not None, catalog=status)
            if ticks % int(REPORT_EVERY_S / period_s) == 0:
                self._report()
            ticks += 1


def load_driver(model_dir: str, device: str, options: ReplicaOptions, limits: EngineLimits) -> AsyncEngine:
    """The replica's AsyncEngine over the model directory."""
    scheduler = options.scheduler_config(limits)
    return AsyncEngine(Engine.from_pretrained(model_dir, device=device, scheduler=scheduler, **options.engine_kwargs()))


def describe(engine: Engine, model_dir: str, device: str) -> ModelInfo:
    """What /v1/model says about the engine's model (the other family's fields None)."""
    family = engine.family
    return ModelInfo(
        version=engine.model_version,
        model_dir=str(model_dir),
        device=device,
        family=family.name,
        serves=list(family.kinds),
        **family.describe(),
    )


def _file_state(path: str | None) -> tuple | None:
    """What tells a file's versions apart without reading it (None: there is none at `path`)."""
    try:
        stat = os.stat(path)
    except (OSError, TypeError, ValueError):
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


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
