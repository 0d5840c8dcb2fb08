"""AsyncEngine: one Engine driven by a background loop; any number of callers await results.

Requests are validated in the caller's thread (errors raise at once, before queueing); the loop thread
runs `Scheduler.step()` so that requests of every kind, width and prompt length meet in the same
iterations. Cancelling the awaiting task cancels the request and frees its KV at the next iteration.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from pathlib import Path

from genrec.api import RecommendRequest, RecommendResult, RetrieveRequest, RetrieveResult, ScoreRequest, ScoreResult
from genrec.engine.engine import Engine
from genrec.engine.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: Engine, config: SchedulerConfig | None = None, idle_wait_s: float = 0.02):
        self.engine = engine
        self.scheduler = Scheduler(engine, config)
        self._lock = threading.Lock()  # one submitter at a time: the tokenizer is not thread-safe
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s
        self._thread = threading.Thread(target=self._loop, name="genrec-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device: str = "cpu", config: SchedulerConfig | None = None, **kw):
        return cls(Engine.from_pretrained(model_dir, device=device, **kw), config)

    # -- public API ------------------------------------------------------------------------------

    async def retrieve(self, request: RetrieveRequest, timeout_s: float | None = None) -> RetrieveResult:
        return await asyncio.wrap_future(self.submit(request, timeout_s))

    async def score(self, request: ScoreRequest, timeout_s: float | None = None) -> ScoreResult:
        return await asyncio.wrap_future(self.submit(request, timeout_s))

    async def recommend(self, request: RecommendRequest, timeout_s: float | None = None) -> RecommendResult:
        return await asyncio.wrap_future(self.submit(request, timeout_s))

    def submit(self, request, timeout_s: float | None = None) -> Future:
        """Thread-safe, non-blocking: validate, queue, return a future. Raises Overloaded when full."""
        if self._stop.is_set():
            raise RuntimeError("the engine is shut down")
        with self._lock:
            prepared = self.engine.prepare(request)
            future = self.scheduler.submit(prepared, timeout_s)
        self._wake.set()
        return future

    def metrics(self) -> dict:
        snapshot = self.scheduler.metrics.snapshot()
        cache = self.scheduler.cache
        snapshot["context_cache"] = {"entries": len(cache._items), "hits": cache.hits, "misses": cache.misses}
        return snapshot

    @property
    def kv_bytes_reserved(self) -> int:
        return self.scheduler.budget.reserved

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    # -- the loop --------------------------------------------------------------------------------

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
