"""The continuous-batching scheduler: one `step()` is one iteration of the engine loop.

Each iteration (1) drops cancelled and timed-out requests, freeing their KV at once; (2) admits waiting
requests in arrival order while the KV budget allows; (3) prefills under a token budget, in chunks, so a
long prompt does not starve running decodes; (4) scores the requests whose prefill finished and starts
beam cohorts for the others; (5) runs ONE decode pass for every running beam of every request. No Ray,
no threads here: the AsyncEngine drives it. Every model call is guarded so a failing request fails alone.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, replace

import torch

from genrec import attention
from genrec.api import RetrieveResult
from genrec.engine.beam import BeamCohort, fetch_finals
from genrec.engine.checks import check_int, check_seconds
from genrec.engine.context_cache import ContextCache, context_key
from genrec.engine.decode import decode_step
from genrec.engine.decode_graph import DecodeRunner
from genrec.engine.engine import Engine, Prefilled
from genrec.engine.kv_budget import Holding, KVBudget, kv_bytes_per_token, request_kv_tokens
from genrec.engine.metrics import EngineMetrics
from genrec.engine.prepared import Prepared
from genrec.errors import InvalidRequestError, Overloaded, RequestTimeout


@dataclass
class SchedulerConfig:
    max_queue: int = 256  # waiting requests; beyond it submit fails fast with Overloaded
    # Requests in prefill or decode at once (None: by device). Each running request costs some host work
    # per step (its context attention call, its beam selection). On an H200 with Qwen3-1.7B, 8 gave the
    # highest throughput (about 20 QPS at prompt 2000 / beam 30 / 5 levels; 14.8 QPS at 16); on a CPU,
    # where compute rather than launches bounds a step, more requests per step pay (64).
    max_running: int | None = None
    prefill_tokens_per_step: int = 4096  # chunked-prefill budget of one iteration
    kv_budget_bytes: int | None = None  # the KV pool, preallocated: 4 GiB on CPU, half the free memory on CUDA
    request_timeout_s: float = 60.0
    context_cache_entries: int = 0  # LRU of recent prefills by exact prompt (held in the pool); 0 = off

    def __post_init__(self):
        """Zero would stall the engine (every request times out) or refuse everything: refused here instead."""
        check_int("max_queue", self.max_queue)
        check_int("prefill_tokens_per_step", self.prefill_tokens_per_step)
        check_seconds("request_timeout_s", self.request_timeout_s)
        check_int("context_cache_entries", self.context_cache_entries, least=0)
        for name in ("max_running", "kv_budget_bytes"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name))


# What `Scheduler.reconfigure` may change while requests run (the KV budget and the cache are sized once).
LIVE_FIELDS = ("request_timeout_s", "max_queue", "max_running", "prefill_tokens_per_step")


@dataclass(eq=False)
class Job:
    prepared: Prepared
    future: Future
    submitted: float
    deadline: float
    kv_bytes: int
    embeds: torch.Tensor | None = None
    ctx_key: bytes | None = None
    prefilled: Prefilled | None = None
    partial: object = None  # ContextKV while prefilling in chunks
    cohort: BeamCohort | None = None
    retrieved: RetrieveResult | None = None  # recommend: the beams, waiting to be ranked
    holding: Holding | None = None  # its extents of the KV pool, from admission to the end

    @property
    def kind(self) -> str:
        return self.prepared.kind


class Scheduler:
    def __init__(self, engine: Engine, config: SchedulerConfig | None = None):
        self.engine = engine
        self.config = _by_device(config or SchedulerConfig(), engine.device)
        self.model = engine.model
        self.per_token = kv_bytes_per_token(self.model.config, self.model.dtype.itemsize)
        budget = self.config.kv_budget_bytes
        budget = budget if budget is not None else _default_budget(engine.device)
        self.budget = KVBudget(engine.new_pool(budget // self.per_token))
        self.cache = ContextCache(self.config.context_cache_entries)
        # Static-shape decode passes replayed as CUDA graphs: only on CUDA with the (unverified) fast switch.
        fast = attention.CUDA_FAST and engine.device.type == "cuda"
        self.runner = DecodeRunner(self.model, self.budget.pool, engine.catalog.levels, graphs=True) if fast else None
        self.metrics = EngineMetrics()
        self.inbox: deque[Job] = deque()  # appended by submitters, drained by the loop (deque ops are atomic)
        self.waiting: deque[Job] = deque()
        self.prefilling: list[Job] = []
        self.decoding: list[Job] = []

    # -- submission (any thread; the AsyncEngine serialises submitters) ---------------------------

    def reconfigure(self, **fields) -> SchedulerConfig:
        """Change live limits (LIVE_FIELDS) between iterations; the new values are validated first."""
        fixed = sorted(set(fields) - set(LIVE_FIELDS))
        if fixed:
            raise InvalidRequestError(fixed[0], f"cannot change on a running engine (live: {', '.join(LIVE_FIELDS)})")
        self.config = _by_device(replace(self.config, **fields), self.engine.device)  # one atomic swap
        return self.config

    def submit(self, prepared: Prepared, timeout_s: float | None = None) -> Future:
        timeout_s = check_seconds("timeout_s", timeout_s) if timeout_s is not None else self.config.request_timeout_s
        kv_bytes = self.per_token * request_kv_tokens(prepared, self.engine.catalog.levels)
        if kv_bytes > self.budget.capacity:
            raise InvalidRequestError(
                "request", f"needs {kv_bytes} bytes of KV; this engine's budget is {self.budget.capacity}"
            )
        if len(self.waiting) + len(self.inbox) >= self.config.max_queue:
            raise Overloaded(f"engine queue is full ({self.config.max_queue} waiting requests)")
        now = time.monotonic()
        job = Job(prepared, Future(), now, now + timeout_s, kv_bytes)
        self.inbox.append(job)
        return job.future

    @property
    def idle(self) -> bool:
        return not (self.inbox or self.waiting or self.prefilling or self.decoding)

    # -- one iteration (the loop thread) ---------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> bool:
        while self.inbox:
            self.waiting.append(self.inbox.popleft())
        self._reap(time.monotonic())
        ready = self._admit()
        prefill_tokens, prefilled = self._prefill()
        ready += prefilled
        self._start(ready)
        rows = self._decode()
        m = self.metrics
        m.queue_depth, m.running = len(self.waiting), len(self.prefilling) + len(self.decoding)
        m.kv_bytes_reserved = self.budget.reserved
        if prefill_tokens or rows or ready:
            m.steps += 1
            m.prefill_tokens_per_step.observe(prefill_tokens)
            m.batch_rows_per_step.observe(rows)
            return True
        return False

    def _reap(self, now: float) -> None:
        for queue in (self.prefilling, self.decoding):
            for job in [j for j in queue if j.future.cancelled() or now > j.deadline]:
                queue.remove(job)
                self._end(job)
        for job in [j for j in self.waiting if j.future.cancelled() or now > j.deadline]:
            self.waiting.remove(job)
            self._end(job)

    def _end(self, job: Job) -> None:
        """A job left the engine without a result: cancelled or timed out."""
        if job.future.cancelled():
            self._finish(job, status="cancelled")
        else:
            waited = time.monotonic() - job.submitted
            self._finish(job, error=RequestTimeout(f"request did not finish within {waited:.1f} s"), status="timeout")

    def _admit(self) -> list[Job]:
        ready = []
        while self.waiting and len(self.prefilling) + len(self.decoding) + len(ready) < self.config.max_running:
            job = self.waiting[0]
            job.ctx_key = context_key(job.prepared) if self.cache.entries else None
            job.holding = self._hold(job)
            if job.holding is None:
                break  # in arrival order: the head waits for memory, nobody overtakes it
            self.waiting.popleft()
            cached = self.cache.get(job.ctx_key) if job.ctx_key else None
            if cached is not None:
                job.prefilled = cached
                self._first_step(job)
                ready.append(job)
            else:
                self.prefilling.append(job)
        return ready

    def _hold(self, job: Job) -> Holding | None:
        """The job's extents of the pool (sharing a cached prompt's); the context cache gives up its oldest
        prompts while they do not fit (perhaps the job's own: then it prefills after all)."""
        tokens = job.kv_bytes // self.per_token
        prompt = len(job.prepared.token_ids)
        while True:
            cached = self.cache.peek(job.ctx_key) if job.ctx_key else None
            holding = self.budget.admit(tokens, prompt, cached.ctx if cached is not None else None)
            if holding is not None or not self.cache.evict_oldest():
                return holding

    def _prefill(self) -> tuple[int, list[Job]]:
        """This iteration's prefill chunks, in arrival order under the token budget, in one packed pass."""
        budget, chunks = self.config.prefill_tokens_per_step, []
        for job in list(self.prefilling):
            if budget <= 0:
                break
            if job.partial is None:
                self._first_step(job)
                self._guarded([job], self._begin_prefill)
                if job.partial is None:
                    continue  # it failed, alone
            start = job.partial.length
            n = min(len(job.prepared.token_ids) - start, budget)
            chunks.append((job, start, n))
            budget -= n
        done: list[Job] = []
        self._guarded([job for job, _, _ in chunks], lambda jobs: done.extend(self._run_chunks(chunks, jobs)))
        for job in done:
            self.prefilling.remove(job)
        return self.config.prefill_tokens_per_step - budget, done

    def _begin_prefill(self, jobs: list[Job]) -> None:
        (job,) = jobs
        job.embeds = self.engine.prompt_embeds(job.prepared)
        job.partial = job.holding.ctx

    def _run_chunks(self, chunks, jobs: list[Job]) -> list[Job]:
        chunks = [c for c in chunks if c[0] in jobs]
        for job, start, _ in chunks:
            job.partial.length = start  # a retried pass rewrites the same positions
        segments = [(job.embeds[start : start + n], job.partial) for job, start, n in chunks]
        logits = self.model.prefill_packed(segments)
        done = []
        for (job, _, _), row in zip(chunks, logits, strict=True):
            if job.partial.length == len(job.prepared.token_ids):
                job.prefilled, job.embeds, job.partial = Prefilled(job.partial, row), None, None
                if job.ctx_key is not None:
                    self.cache.put(job.ctx_key, job.prefilled)
                done.append(job)
        return done

    def _start(self, ready: list[Job]) -> None:
        scoring = [j for j in ready if not j.prepared.beams]
        self._guarded(scoring, self._score)
        for job in (j for j in ready if j.prepared.beams):
            self._guarded([job], self._start_beams)

    def _start_beams(self, jobs: list[Job]) -> None:
        (job,) = jobs
        job.cohort = self.engine.start_beams([job.prepared], [job.prefilled], slots=job.holding.rest)
        self.decoding.append(job)
        if job.cohort.done:  # a one-level code: nothing to decode
            self._beams_done([job])

    def _score(self, jobs: list[Job]) -> None:
        engine = self.engine
        scores = engine.score_many([engine.score_job(j.prepared, j.prefilled) for j in jobs])
        for job, s in zip(jobs, scores, strict=True):
            self._finish(job, engine.score_result(job.prepared, job.prefilled, s))

    def _decode(self) -> int:
        running = [j for j in self.decoding if not j.cohort.done]
        if not running:
            return 0
        rows = sum(j.cohort.rows for j in running)
        self._guarded(running, lambda jobs: decode_step(self.model, [j.cohort for j in jobs], self.runner))
        self._beams_done([j for j in running if j in self.decoding and j.cohort.done])
        return rows

    def _beams_done(self, jobs: list[Job]) -> None:
        recommends = []
        finals = fetch_finals([job.cohort for job in jobs]) if jobs else []  # one host sync for all
        for job, host in zip(jobs, finals, strict=True):
            self.decoding.remove(job)
            self._guarded([job], lambda one, host=host: self._beams_result(one[0], host, recommends))
        self._guarded(recommends, self._rank)

    def _beams_result(self, job: Job, host, recommends: list[Job]) -> None:
        (result,) = self.engine.retrieve_results([job.prepared], [job.prefilled], job.cohort, host)
        if job.kind == "retrieve":
            self._finish(job, result)
        else:
            job.retrieved = result
            recommends.append(job)

    def _rank(self, jobs: list[Job]) -> None:
        engine = self.engine
        scores = engine.score_many([engine.score_job(j.prepared, j.prefilled, j.retrieved) for j in jobs])
        for job, s in zip(jobs, scores, strict=True):
            self._finish(job, engine.recommend_result(job.prepared, job.retrieved, s))

    # -- bookkeeping -----------------------------------------------------------------------------

    def fail_all(self, error: BaseException, status: str = "error") -> None:
        """Fail every request in the engine (after an unexpected error in the loop itself, or at shutdown)."""
        while self.inbox:
            self.waiting.append(self.inbox.popleft())
        for queue in (self.waiting, self.prefilling, self.decoding):
            while queue:
                self._finish(queue.pop(), error=error, status=status)

    def _guarded(self, jobs: list[Job], fn) -> None:
        """Run fn on the jobs together; if that raises, run it on each alone so only the culprit fails."""
        if not jobs:
            return
        try:
            fn(jobs)
        except Exception as err:  # noqa: BLE001
            if len(jobs) == 1:
                self._drop(jobs[0])
                self._finish(jobs[0], error=err, status="error")
                return
            for job in jobs:
                self._guarded([job], fn)

    def _drop(self, job: Job) -> None:
        for queue in (self.prefilling, self.decoding):
            if job in queue:
                queue.remove(job)

    def _first_step(self, job: Job) -> None:
        self.metrics.time_to_first_step[job.kind].observe(time.monotonic() - job.submitted)

    def _finish(self, job: Job, result=None, error: BaseException | None = None, status: str = "ok") -> None:
        if job.holding is not None:
            self.budget.release(job.holding)
            job.holding = None
        job.cohort = job.embeds = job.partial = job.prefilled = job.retrieved = None
        try:
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)
        except InvalidStateError:
            pass  # the caller cancelled meanwhile: nobody waits for this result
        self.metrics.finished(job.kind, status, time.monotonic() - job.submitted)
        self.metrics.kv_bytes_reserved = self.budget.reserved


def _by_device(config: SchedulerConfig, device: torch.device) -> SchedulerConfig:
    if config.max_running is not None:
        return config
    return replace(config, max_running=8 if device.type == "cuda" else 64)


def _default_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    return 4 << 30
