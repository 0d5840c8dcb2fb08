"""AsyncEngine: one Engine's scheduler stepped by a background loop; any number of callers await results
(docs/engine.md, 'Many concurrent callers: AsyncEngine'). Requests are validated in the caller's thread, before
queueing; while the loop runs, the engine's synchronous API refuses callers.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import time
import weakref
from concurrent.futures import Future, InvalidStateError
from pathlib import Path

from genrec.api import (
    PromptForms,
    PromptResult,
    RankRequest,
    RankResult,
    RecommendRequest,
    RecommendResult,
    RetrieveRequest,
    RetrieveResult,
    ScoreRequest,
    ScoreResult,
)
from genrec.engine.engine import Engine
from genrec.engine.family import KINDS
from genrec.engine.metrics import outcome_of
from genrec.engine.scheduler import SchedulerConfig
from genrec.errors import EngineStopped

log = logging.getLogger(__name__)

_LIVE: weakref.WeakSet = weakref.WeakSet()  # every AsyncEngine whose loop may still run


@atexit.register
def _stop_loops_at_exit() -> None:
    """A loop thread still inside a step when the interpreter finalizes aborts the process (torch's C++ threads
    are torn down under it): at exit, stop every loop and let its current step end first."""
    engines = list(_LIVE)
    for engine in engines:
        engine._stop.set()
        engine._wake.set()
    for engine in engines:
        engine._thread.join(30.0)


class AsyncEngine:
    def __init__(self, engine: Engine, idle_wait_s: float = 0.02, stall_s: float = 60.0):
        """`stall_s`: a step running longer than this marks the engine unhealthy (its pass is stuck, or far larger
        than any should be), so Serve's health check replaces the replica instead of letting it time out."""
        if engine.driver is not None and engine.driver.healthy:
            raise RuntimeError("another AsyncEngine drives this engine")
        self.engine = engine
        self.scheduler = engine.start()  # captures and warm-up here, before the loop serves anyone
        engine.driver = self
        self._lock = threading.Lock()  # one submitter at a time: the tokenizer is not thread-safe
        self._closed = False  # set under _lock: after it, nothing new is admitted
        self._held: set[Future] = set()  # the futures of every unfinished request: what a shutdown settles
        self._settled = threading.Condition()  # notified whenever a held future is done
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s
        self.stall_s = stall_s
        self._thread = threading.Thread(target=self._loop, name="genrec-engine-loop", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device: str = "cpu", config: SchedulerConfig | None = None, **kw):
        return cls(Engine.from_pretrained(model_dir, device=device, scheduler=config, **kw))

    async def retrieve(self, request: RetrieveRequest, timeout_s: float | None = None) -> RetrieveResult:
        return await asyncio.wrap_future(self.submit(request, timeout_s, "retrieve"))

    async def score(self, request: ScoreRequest, timeout_s: float | None = None) -> ScoreResult:
        return await asyncio.wrap_future(self.submit(request, timeout_s, "score"))

    async def recommend(self, request: RecommendRequest, timeout_s: float | None = None) -> RecommendResult:
        return await asyncio.wrap_future(self.submit(request, timeout_s, "recommend"))

    async def rank(self, request: RankRequest, timeout_s: float | None = None) -> RankResult:
        return await asyncio.wrap_future(self.submit(request, timeout_s, "rank"))

    def render_prompt(self, request: PromptForms) -> PromptResult:
        """Thread-safe: `Engine.render_prompt`, one caller at a time like a submit (the tokenizer is shared)."""
        with self._lock:
            return self.engine.render_prompt(request)

    def submit(self, request, timeout_s: float | None = None, kind: str | None = None) -> Future:
        """Thread-safe, non-blocking: validate, queue, return a future; a refusal counts as the request's outcome."""
        try:
            with self._lock:
                if not self.healthy:
                    raise EngineStopped(self._unhealthy_reason())
                prepared = self.engine.prepare(request, kind)
                future = self.scheduler.submit(prepared, timeout_s)
                with self._settled:
                    self._held.add(future)
                future.add_done_callback(self._release)
        except Exception as err:
            self.refused(kind or _kind_of(request), err)
            raise
        self._wake.set()
        return future

    def refused(self, kind: str, err: BaseException) -> None:
        """Count a request that ended before the engine queued it (refused here, or by the caller)."""
        self.scheduler.refused(kind, outcome_of(err))

    @property
    def healthy(self) -> bool:
        """False once shut down, when the loop thread is dead, or while one step has run past `stall_s`."""
        return not self._closed and self._thread.is_alive() and not self.stalled

    @property
    def stalled(self) -> bool:
        return self.scheduler.step_in_flight_s() > self.stall_s

    def _unhealthy_reason(self) -> str:
        if self._closed:
            return "the engine is shut down"
        if self.stalled:
            return f"the engine loop has been in one step for over {self.stall_s:.0f} s"
        return "the engine loop is not running"

    def load_catalog(self, path) -> dict:
        """`Engine.load_catalog`: built in the caller's thread while the loop steps, swapped between requests."""
        return self.engine.load_catalog(path)

    @property
    def live_catalog(self) -> bool:
        """`Engine.live_catalog`: whether its catalog changes live (a decoder's)."""
        return self.engine.live_catalog

    def catalog_state(self) -> dict:
        """The catalog served now: `Engine.catalog_state()` and its items (`catalog_items`)."""
        return self.engine.catalog_state() | {"catalog_items": len(self.engine.catalog)}

    def describe(self) -> dict:
        """`Engine.describe`."""
        return self.engine.describe()

    def rollback_catalog(self) -> dict:
        return self.engine.rollback_catalog()

    def reconfigure(self, **fields) -> SchedulerConfig:
        return self.scheduler.reconfigure(**fields)

    def metrics(self) -> dict:
        execution = self.engine.describe_execution()
        graphs = {"warmup_s": execution["warmup_s"], "uncaptured_passes": execution["uncaptured_passes"]}
        return self.scheduler.snapshot() | {"graphs": graphs}

    @property
    def kv_bytes_reserved(self) -> int:
        return self.scheduler.kv_bytes_reserved

    @property
    def work_in_flight(self) -> int:
        """`Scheduler.work_in_flight`: read from any thread, no lock, no device sync."""
        return self.scheduler.work_in_flight

    def shutdown(self, timeout_s: float = 10.0, drain: bool = False) -> None:
        """Stop admitting; settle every held request (EngineStopped now, or with `drain` after up to `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._closed = True
        if drain:
            with self._settled:
                self._settled.wait_for(lambda: not self._held, timeout=max(0.0, deadline - time.monotonic()))
        self._stop.set()
        self._wake.set()
        with self._settled:
            held = list(self._held)
        stopped = EngineStopped("the engine shut down before this request finished")
        for future in held:
            try:
                future.set_exception(stopped)
            except InvalidStateError:
                pass  # it finished or was cancelled meanwhile
        self._thread.join(max(0.0, deadline - time.monotonic()))

    def _release(self, future: Future) -> None:
        with self._settled:
            self._held.discard(future)
            self._settled.notify_all()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                worked = self.scheduler.step()
            except Exception as err:  # a bug, not a request's fault: fail what is in flight, keep serving
                log.exception("engine loop step failed")
                self.scheduler.fail_all(err)
                worked = False
            if not worked:
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
        # Stopped: free the KV of what was still running (its callers already have EngineStopped).
        self.scheduler.fail_all(EngineStopped("the engine shut down before this request finished"), status="stopped")


def _kind_of(request) -> str:
    """The kind a request is counted under when it was refused before its kind was checked."""
    return next((kind for kind, cls in KINDS.items() if isinstance(request, cls)), "unknown")
