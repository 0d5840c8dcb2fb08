"""The continuous-batching scheduler: the one place that sequences work (docs/engine.md, 'How a request runs').

One `step()`, in this order: reap cancelled and timed-out jobs (again between passes: a request ends within one
pass of its deadline); admit in arrival order under the KV budget, each reusing its longest cached prefix; prefill
in chunks under the token budget and the cost bound; move prefilled jobs on (the family says generate or rows); ONE
decode pass for every generating row; one bounded rows pass. Knows no model family, no Ray, no threads; every model
call is guarded so a failing request fails alone. Time comes from the given `clock`, so deadlines test exactly.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, replace

import torch

from genrec.engine.beam import fetch_finals
from genrec.engine.family import Family
from genrec.engine.job import Job, JobState, Prepared
from genrec.engine.metrics import EngineMetrics
from genrec.engine.prefix_cache import BLOCK, CacheStats, HostTier, PrefixCache
from genrec.engine.runner import ModelRunner
from genrec.errors import InvalidRequestError, Overloaded, RequestTimeout
from genrec.model.kv_pool import Holding, KVBudget, kv_bytes_per_token

WAITING, PREFILLING, DECODING, SCORING, FINISHED = JobState


# Checks of engine settings: a bad value is refused by name, never read as "use the default".
def check_int(name: str, value, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidRequestError(name, f"must be an integer >= {least}, got {value!r}")
    return value


def check_seconds(name: str, value) -> float:
    """A positive duration (infinity: no limit). Zero is refused: nothing could ever finish in it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise InvalidRequestError(name, f"must be a positive number of seconds, got {value!r}")
    return value


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
    # Prompts' K/V kept for reuse by later prompts with the same start, inside the pool (None: half of it; 0: off).
    prefix_cache_bytes: int | None = None
    # Host memory that prefixes evicted from the pool spill to (CUDA; verified on an H200, opt-in: off by default).
    host_cache_bytes: int = 0

    def __post_init__(self):
        """Zero would stall the engine (every request times out) or refuse everything: refused here instead."""
        check_int("max_queue", self.max_queue)
        check_int("prefill_tokens_per_step", self.prefill_tokens_per_step)
        check_seconds("request_timeout_s", self.request_timeout_s)
        check_int("host_cache_bytes", self.host_cache_bytes, least=0)
        if self.prefix_cache_bytes is not None:
            check_int("prefix_cache_bytes", self.prefix_cache_bytes, least=0)
        for name in ("max_running", "kv_budget_bytes"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name))


# What `Scheduler.reconfigure` may change while requests run (the KV budget and the cache are sized once).
LIVE_FIELDS = ("request_timeout_s", "max_queue", "max_running", "prefill_tokens_per_step")


class Scheduler:
    """Sequences the requests of one family, whose passes `runner` makes (an Engine's: `genrec.engine.Engine`)."""

    def __init__(
        self,
        family: Family,
        runner: ModelRunner,
        config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        model_version: str = "",
    ):
        self.family, self.runner = family, runner
        self.salt = model_version.encode()  # cached prefixes of another model version never match
        self.device = runner.device
        self.clock = clock
        self.config = by_device(config or SchedulerConfig(), self.device)
        model = self.runner.model
        self.per_token = kv_bytes_per_token(model.config, model.dtype.itemsize)
        budget = self.config.kv_budget_bytes
        budget = budget if budget is not None else _default_budget(self.device)
        self.budget = KVBudget(self.runner.new_pool(budget // self.per_token))
        cache_bytes = self.config.prefix_cache_bytes
        host = HostTier(self.config.host_cache_bytes, self.budget.pool) if self.config.host_cache_bytes else None
        self.cache = PrefixCache(
            cache_bytes if cache_bytes is not None else self.budget.capacity // 2,
            host=host,
            gain=self.family.cost.reuse_gain,  # pieces that cost more than they save are not read
        )
        self.metrics = EngineMetrics(clock)
        self.inbox: deque[Job] = deque()  # appended by submitters, drained by the loop (deque ops are atomic)
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []  # admitted, in admission order; their state says what they need next
        # The work of every request taken and of every one settled (`work_of`): each written by one thread (the
        # submitter, the loop), so no update is lost and `work_in_flight` needs no lock.
        self.work_submitted = self.work_finished = 0

    # -- submission (any thread; the AsyncEngine serialises submitters) ---------------------------

    def reconfigure(self, **fields) -> SchedulerConfig:
        """Change live limits (LIVE_FIELDS) between iterations; the new values are validated first."""
        fixed = sorted(set(fields) - set(LIVE_FIELDS))
        if fixed:
            raise InvalidRequestError(fixed[0], f"cannot change on a running engine (live: {', '.join(LIVE_FIELDS)})")
        self.config = by_device(replace(self.config, **fields), self.device)  # one atomic swap
        return self.config

    def submit(self, prepared: Prepared, timeout_s: float | None = None) -> Future:
        timeout_s = check_seconds("timeout_s", timeout_s) if timeout_s is not None else self.config.request_timeout_s
        tokens = prepared.kv_tokens
        if tokens * self.per_token > self.budget.capacity:
            raise InvalidRequestError(
                "request",
                f"needs {tokens} tokens of KV ({tokens * self.per_token} bytes: its context and what it generates);"
                f" this engine's pool holds {self.budget.capacity // self.per_token} ({self.budget.capacity} bytes):"
                " send a shorter prompt or history, or a narrower beam",
            )
        if not self.has_room:
            raise Overloaded(f"engine queue is full ({self.config.max_queue} waiting requests)")
        now = self.clock()
        job = Job(prepared, Future(), now, now + timeout_s, tokens)
        self.work_submitted += self.work_of(prepared)
        self.inbox.append(job)
        return job.future

    def work_of(self, prepared: Prepared) -> int:
        """What a request asks of the engine, in the token-equivalents of its pass budgets (pass_cost.py): every token
        it holds in the pool (its context, beam suffixes, candidate rows) and every row it scores without one,
        computed once, each attending to its context. Rows x context makes a wide beam over a long prompt weigh what
        it costs; the per-token term keeps a narrow request from weighing nothing. From the host-side request alone:
        no device work, no sync."""
        context = len(prepared.token_ids)
        return round((prepared.kv_tokens + prepared.scored_rows) * (1 + context / self.family.cost.context_span))

    @property
    def work_in_flight(self) -> int:
        """The work (`work_of`) of the requests queued and running now: what an engine replica reports to Serve's
        autoscaler (genrec.serving.autoscaling). A running sum, added at submit and taken off when a request is
        settled, so reading it walks no queue."""
        return self.work_submitted - self.work_finished

    def forget_counts(self) -> None:
        """Metrics and cache statistics from zero: the engine's own warm-up requests are not its callers'."""
        self.metrics = EngineMetrics(self.clock)
        self.cache.stats = CacheStats()

    def snapshot(self) -> dict:
        """The counts and timings so far, the prefix cache's among them (an engine's `metrics`)."""
        return self.metrics.snapshot() | {"prefix_cache": self.cache.snapshot()}

    def refused(self, kind: str, outcome: str) -> None:
        """Count a request that ended before it was queued (refused by its driver)."""
        self.metrics.finished(kind, outcome)

    def step_in_flight_s(self) -> float:
        """How long the step now running has run (0 between steps)."""
        return self.metrics.step_in_flight_s()

    @property
    def kv_bytes_reserved(self) -> int:
        return self.budget.reserved

    @property
    def has_room(self) -> bool:
        return len(self.waiting) + len(self.inbox) < self.config.max_queue

    @property
    def idle(self) -> bool:
        return not (self.inbox or self.waiting or self.running)

    # -- one iteration (the loop thread) ---------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> bool:
        """One iteration; False when it found nothing to do."""
        self.metrics.step_started = self.clock()
        try:
            return self._step()
        finally:
            self.metrics.step_started = None

    def _step(self) -> bool:
        while self.inbox:
            self.waiting.append(self.inbox.popleft())
        self._reap(self.clock())
        self._admit()
        prefill_tokens, ready = self._prefill()
        self._reap(self.clock())  # deadlines are checked between the passes of a step, too
        self._start([job for job in ready if not job.finished])
        rows = self._decode()
        self._reap(self.clock())
        scored = self._score()
        m = self.metrics
        m.queue_depth, m.running = len(self.waiting), len(self.running)
        m.beam_rows = sum(j.cohort.rows for j in self.in_state(DECODING))
        m.context_tokens = sum(len(j.prepared.token_ids) for j in self.running)
        m.kv_bytes_reserved = self.budget.reserved
        if prefill_tokens or rows or ready or scored:
            m.steps += 1
            m.prefill_tokens_per_step.observe(prefill_tokens)
            m.batch_rows_per_step.observe(rows)
            return True
        return False

    def in_state(self, state: JobState) -> list[Job]:
        return [j for j in self.running if j.state is state]

    def _reap(self, now: float) -> None:
        for job in [j for j in (*self.waiting, *self.running) if j.future.cancelled() or now > j.deadline]:
            if job.future.cancelled():
                self._finish(job, status="cancelled")
            else:
                waited = self.clock() - job.submitted
                error = RequestTimeout(f"request did not finish within {waited:.1f} s")
                self._finish(job, error=error, status="timeout")

    def _admit(self) -> None:
        """Waiting jobs, in arrival order, into the pool while they fit (reusing their longest cached prefix)."""
        while self.waiting and len(self.running) < self.config.max_running:
            job = self.waiting[0]
            if job.block_keys is None and self.cache.enabled:
                job.block_keys = self.family.block_keys(job.prepared, self.salt)
            job.holding = self._hold(job)
            if job.holding is None:
                break  # in arrival order: the head waits for memory, nobody overtakes it
            self.waiting.popleft()
            self.running.append(job)
            job.move(PREFILLING)  # at least its last token: the logits there start its beams or rows
            stats = self.cache.stats
            stats.tokens_prompted += len(job.prepared.token_ids)
            stats.tokens_reused += job.ctx.prefix_length
            stats.hits += job.ctx.prefix_length > 0

    def _hold(self, job: Job) -> Holding | None:
        """The job's pool extents after its longest cached prefix (never the whole prompt), evicting until it fits.

        Blocks come back from the host tier on the first lookup only, and the job's own cached blocks are evicted
        last, only when no running job will free memory: otherwise an entry copied back, then evicted to the host
        again to make room beside a running job, would come back on the next lookup, round after round."""
        prompt = len(job.prepared.token_ids)
        restore = True
        while True:
            prefix = self.cache.lookup(job.block_keys, (prompt - 1) // BLOCK, restore) if self.cache.enabled else []
            restore = False
            reused = sum(p.length for p in prefix)
            holding = self.budget.admit(prompt - reused, job.kv_tokens - prompt, prefix)
            if holding is not None:
                return holding
            for piece in prefix:
                piece.extent.release()
            if not self.cache.evict_one(keep=self.cache.extents_of(job.block_keys or []) if self.running else ()):
                return None  # it waits for a running job's memory, its prefix kept in the pool

    def _prefill(self) -> tuple[int, list[Job]]:
        """This iteration's prefill chunks, in arrival order under the token budget, in one packed pass costing at
        most one whole-budget chunk from a prompt's start (so a chunk deep into a long prompt is shorter)."""
        budget, chunks = self.config.prefill_tokens_per_step, []
        cost = self.family.cost
        spend = cost.prefill(0, budget)
        for job in self.in_state(PREFILLING):
            start = job.ctx.length
            n = min(len(job.prepared.token_ids) - start, budget, cost.prefill_fits(start, spend))
            if n <= 0 and chunks:
                break
            n = max(n, 1)  # the pass's first chunk moves on even where one token costs more than the budget
            if start == job.ctx.prefix_length:
                self._first_step(job)
            chunks.append((job, start, n))
            budget -= n
            spend -= cost.prefill(start, n)
        done: list[Job] = []
        self._guarded([job for job, _, _ in chunks], lambda jobs: done.extend(self._run_chunks(chunks, jobs)))
        return self.config.prefill_tokens_per_step - budget, done

    def _run_chunks(self, chunks, jobs: list[Job]) -> list[Job]:
        chunks = [c for c in chunks if c[0] in jobs]
        logits = self.runner.prefill([(job.prepared, job.ctx, start, n) for job, start, n in chunks])
        done = []
        for (job, _, _), row in zip(chunks, logits, strict=True):
            if job.ctx.length == len(job.prepared.token_ids):
                job.last_logits = row
                self.cache.insert(job.block_keys, job.ctx)
                done.append(job)
        return done

    def _start(self, ready: list[Job]) -> None:
        """Prefilled jobs on to the state their family says: generating, or running rows."""
        for job in ready:
            self._guarded([job], self._start_one)

    def _start_one(self, jobs: list[Job]) -> None:
        (job,) = jobs
        job.move(self.family.start(job))
        if job.state is JobState.DECODING and job.cohort.done:  # a one-level code: nothing to decode
            self._generated([job])

    def _decode(self) -> int:
        """Decode passes of whole requests in admission order, each as one captured pass holds (`pass_holds`)."""
        decoding = self.in_state(DECODING)
        rows = sum(j.cohort.rows for j in decoding)
        for jobs in _passes(decoding, self.runner.pass_holds):
            self._guarded(jobs, lambda jobs: self.runner.decode([j.cohort for j in jobs]))
        self._generated([j for j in decoding if j.state is DECODING and j.cohort.done])
        return rows

    def _generated(self, jobs: list[Job]) -> None:
        finals = fetch_finals([job.cohort for job in jobs]) if jobs else []  # one host sync for all
        for job, host in zip(jobs, finals, strict=True):
            self._guarded([job], lambda one, host=host: self._generated_one(one[0], host))

    def _generated_one(self, job: Job, host) -> None:
        (beams,) = job.cohort.results(host)
        result = self.family.generated(job, beams)
        if result is not None:
            self._finish(job, result)
        else:
            job.cohort = None
            job.move(SCORING)

    def _score(self) -> int:
        """One bounded pass of rows for the jobs in SCORING (rows of many jobs share it); a job whose rows are all
        done finishes. Many candidates spread over steps, so others' decode passes run between."""
        scoring = self.in_state(SCORING)
        self._guarded(scoring, self._rows_pass)
        return len(scoring)

    def _rows_pass(self, jobs: list[Job]) -> None:
        self.runner.rows_pass(jobs, self.family.score_max_tokens)
        for job in jobs:
            if job.result is not None:
                self._finish(job, job.result)

    # -- bookkeeping -----------------------------------------------------------------------------

    def fail_all(self, error: BaseException, status: str = "error") -> None:
        """Fail every request in the engine (an unexpected error in the loop itself, or shutdown)."""
        while self.inbox:
            self.waiting.append(self.inbox.popleft())
        for job in [*self.waiting, *self.running]:
            self._finish(job, error=error, status=status)

    def _guarded(self, jobs: list[Job], fn) -> None:
        """Run fn on the jobs together; if that raises, run it on each still unfinished one alone, so only the
        culprit fails (a job fn already finished is never run again)."""
        if not jobs:
            return
        try:
            fn(jobs)
        except Exception as err:  # noqa: BLE001
            if len(jobs) == 1:
                if not jobs[0].finished:
                    self._finish(jobs[0], error=err, status="error")
                return
            for job in jobs:
                if not job.finished:
                    self._guarded([job], fn)

    def _first_step(self, job: Job) -> None:
        self.metrics.time_to_first_step[job.kind].observe(self.clock() - job.submitted)

    def _finish(self, job: Job, result=None, error: BaseException | None = None, status: str = "ok") -> None:
        """Settle the job's future and give its KV back (from any state)."""
        (self.running if job in self.running else self.waiting).remove(job)
        job.move(FINISHED)
        self.work_finished += self.work_of(job.prepared)
        if job.holding is not None:
            self.budget.release(job.holding)
            job.holding = None
            self.cache.trim()  # what it read or handed to the cache may be given back now
        job.cohort = job.last_logits = job.retrieved = job.work = job.result = None
        job.scored = []
        # Counted before the caller can see the answer: metrics read right after it include this request.
        self.metrics.finished(job.kind, status, self.clock() - job.submitted)
        self.metrics.kv_bytes_reserved = self.budget.reserved
        try:
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)
        except InvalidStateError:
            pass  # the caller cancelled meanwhile: nobody waits for this result


def _passes(jobs: list[Job], holds: Callable[[list[int]], bool]) -> list[list[Job]]:
    """The jobs split into consecutive groups one pass `holds` (rows per job; a job it cannot hold with others goes
    alone in its group)."""
    passes, rows = [], []
    for job in jobs:
        if not passes or not holds([*rows, job.cohort.rows]):
            passes.append([])
            rows = []
        passes[-1].append(job)
        rows.append(job.cohort.rows)
    return passes


def by_device(config: SchedulerConfig, device: torch.device) -> SchedulerConfig:
    """The config with what it leaves to the device filled in (`max_running`)."""
    if config.max_running is not None:
        return config
    return replace(config, max_running=8 if device.type == "cuda" else 64)


def _default_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    return 4 << 30
