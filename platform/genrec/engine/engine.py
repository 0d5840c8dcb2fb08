"""The Engine: one model family on one device, its scheduler (and KV pool), and the synchronous API. No Ray here.
`retrieve`, `score`, `recommend` and `rank` are `run` for one kind that raises the first error; an AsyncEngine
steps the same scheduler from a background loop instead (docs/engine.md, 'Building an engine').
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

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
from genrec.attention.choice import HeadShape
from genrec.engine.family import Family, request_kind
from genrec.engine.job import Prepared
from genrec.engine.plan import ExecutionPlan
from genrec.engine.ranker import Ranker
from genrec.engine.retriever import Retriever
from genrec.engine.runner import ModelRunner
from genrec.engine.scheduler import Scheduler, SchedulerConfig, by_device, check_int
from genrec.engine.served_catalog import CatalogVersions
from genrec.engine_options import EngineOptions
from genrec.errors import CatalogError, InvalidRequestError
from genrec.model.directory import ModelDir
from genrec.model.fp8 import quantize_linears
from genrec.staging import host_side

log = logging.getLogger(__name__)

FAMILIES = {"qwen3": Retriever, "hstu": Ranker}  # a model directory's family -> the engine's
LIMITS = ("max_candidates", "score_max_tokens", "max_candidate_tokens", "max_candidate_len")  # the families' limits
DERIVED = ("max_candidate_len",)  # limits whose None means "worked out from the others"


class Engine:
    """One caller at a time; while an AsyncEngine drives it, use that instead."""

    def __init__(
        self,
        family: Family,
        scheduler: SchedulerConfig | None = None,
        model_version: str = "",
        clock: Callable[[], float] = time.monotonic,
        plan: ExecutionPlan | None = None,
        graph_max_rows: int | None = None,
    ):
        """`plan`: what differs by device (genrec.engine.plan), the one the family was built with (default: the
        plain plan, as a family built without one runs)."""
        self.family = family
        self.model, self.device = family.model, family.model.device
        self.plan = plan or ExecutionPlan(self.device)
        self.model_version = model_version  # salts the prefix cache's keys
        self.scheduler_config = scheduler or SchedulerConfig()
        max_requests = by_device(self.scheduler_config, self.device).max_running
        self.runner = ModelRunner(family, self.plan, graph_max_rows, max_requests)
        self.clock = clock
        self._scheduler: Scheduler | None = None
        self._making_scheduler = threading.Lock()
        self.driver = None  # the AsyncEngine stepping the scheduler, while one does

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        device: str = "cpu",
        dtype: torch.dtype | str | None = None,
        scheduler: SchedulerConfig | None = None,
        plan: ExecutionPlan | None = None,
        selects_in_graph: bool = False,
        **options,
    ) -> Engine:
        """The engine of a model directory, whichever family it holds; `options`: EngineOptions' fields; `plan`: the
        execution plan (default: `ExecutionPlan.build` for the device, dtype and options). `selects_in_graph`: the
        decode graphs select their beams (internal until a GPU has timed it: gpu_check)."""
        directory = ModelDir.open(model_dir)
        for name in LIMITS:  # strictly: a bool or a float is refused, not read as a number
            if name in options and not (options[name] is None and name in DERIVED):
                check_int(name, options[name])
        options = EngineOptions(**options)
        if not isinstance(dtype, torch.dtype):
            dtype = _dtype(EngineOptions(dtype=dtype).dtype, device)
        limits = options.model_dump(include=set(LIMITS))
        plan = plan or ExecutionPlan.build(
            device,
            dtype,
            options.cuda_fast,
            options.split_kv,
            selects_in_graph,
            repr(directory.config),
            options.fp8,
            options.attention,
            heads_of(directory),
        )
        if plan.fp8 and directory.family != "qwen3":
            raise ValueError(f"fp8: only a Qwen3 decoder's linear layers run in FP8, not a {directory.family} model's")
        family = FAMILIES[directory.family].from_dir(directory, device, dtype, ops=plan.ops, **limits)
        if plan.fp8:
            quantize_linears(family.model)
        return cls(family, scheduler, directory.version, plan=plan, graph_max_rows=options.cuda_graph_max_rows)

    def describe(self) -> dict:
        """What the engine serves, as /v1/model says it: its model's version and family, the kinds it answers, the
        family's facts (limits, catalog, levels...) and its execution (`describe_execution`)."""
        family = self.family
        facts = {"version": self.model_version, "family": family.name, "serves": list(family.kinds)}
        return facts | {"execution": self.describe_execution()} | family.describe()

    def describe_execution(self) -> dict:
        """What differs by device, as this engine runs it: its plan, and what its start captured (/v1/model)."""
        return self.plan.describe() | self.runner.describe()

    @property
    def catalog(self):
        """The family's catalog served now (a decoder's may change: `load_catalog`)."""
        return self.family.catalog

    # -- catalog versions (a decoder's) ---------------------------------------------------------

    @property
    def live_catalog(self) -> bool:
        """Whether the catalog it serves changes live (`load_catalog`); if not, it is the model directory's."""
        return self.family.catalogs is not None

    def load_catalog(self, path: str | Path) -> dict:
        """Serve the catalog file `path` from the next request on, built in the caller's thread while the engine
        steps, then swapped in by one assignment; returns `catalog_state()` (docs/engine.md, 'Catalog versions,
        live: `load_catalog` / `rollback_catalog`')."""
        versions = self._catalog_versions()
        versions.use(versions.load(path))
        return versions.describe()

    def rollback_catalog(self) -> dict:
        """Serve the version before the last change again (instant: it was kept built)."""
        versions = self._catalog_versions()
        versions.rollback()
        return versions.describe()

    def catalog_state(self) -> dict:
        """The catalog version served now and the one kept for a rollback (None: none)."""
        return self._catalog_versions().describe()

    def _catalog_versions(self) -> CatalogVersions:
        versions = self.family.catalogs
        if versions is None:
            raise CatalogError("catalog", f"this engine's model ({self.family.name}) has no catalog to change live")
        return versions

    @property
    def scheduler(self) -> Scheduler:
        """The started engine's scheduler (`start`)."""
        return self.start()

    def start(self) -> Scheduler:
        """Start the engine, once: its scheduler and KV pool, then what its plan prepares before any request (every
        pass captured as a graph, the compiled pieces warmed up on requests of its own). A replica calls it as it
        starts; the synchronous API on first use. A failed start leaves none (the next call tries again), and no
        other thread can submit while it runs."""
        with self._making_scheduler:
            if self._scheduler is None:
                scheduler = Scheduler(
                    self.family, self.runner, self.scheduler_config, self.clock, model_version=self.model_version
                )
                if self.plan.graphs:  # every decode pass captured now, before any request (never on a live one)
                    seconds = self.runner.capture(scheduler.budget.pool, self.scheduler_config.prefill_tokens_per_step)
                    log.info("captured the decode passes' CUDA graphs in %.1f s", seconds)
                if self.plan.compiles:  # its compiled pieces compile now, on requests of its own
                    log.info("warmed up on the engine's own requests in %.1f s", self._warm_up(scheduler))
                self._scheduler = scheduler
        return self._scheduler

    def _warm_up(self, scheduler: Scheduler) -> float:
        """The family's warm-up requests run to their end, one at a time, before any caller's; counted in
        `runner.warmup_s` (a replica's start) and in no metric. A failure here fails the engine's start."""
        started = time.perf_counter()
        for request in self.family.warmup_requests():
            future = scheduler.submit(self.prepare(request), timeout_s=math.inf)
            while not future.done():
                scheduler.step()
            future.result()
        scheduler.forget_counts()
        seconds = time.perf_counter() - started
        self.runner.warmup_s = (self.runner.warmup_s or 0.0) + seconds
        return seconds

    def retrieve(self, requests: list[RetrieveRequest]) -> list[RetrieveResult]:
        return self._raising(requests, "retrieve")

    def score(self, requests: list[ScoreRequest]) -> list[ScoreResult]:
        return self._raising(requests, "score")

    def recommend(self, requests: list[RecommendRequest]) -> list[RecommendResult]:
        """Beam search, then score the retrieved items plus the given candidates against the same ContextKV."""
        return self._raising(requests, "recommend")

    def rank(self, requests: list[RankRequest]) -> list[RankResult]:
        """A ranking model (HSTU): each request's candidates after its history, every task's probability."""
        return self._raising(requests, "rank")

    def render_prompt(self, request: PromptForms) -> PromptResult:
        """A request's prompt as this engine runs it (text and token IDs), checked as `prepare` does; no compute."""
        with host_side():
            return self.family.render_prompt(request)

    def prepare(self, request, kind: str | None = None) -> Prepared:
        """The request checked against the model (its kind first: one this family serves, `kind` when given)."""
        with host_side():  # request checks on host data, before any device work
            kind = request_kind(request, kind)
            if kind not in self.family.kinds:
                served = " and ".join(self.family.kinds)
                raise InvalidRequestError(
                    "request", f"this engine's model ({self.family.name}) serves {served}, not {kind}"
                )
            return self.family.prepare(request, kind)

    def run(self, requests: list, kind: str | None = None) -> list:
        """Every request's result, or the exception it failed with, in order (`kind`: each must be that kind); any
        exception is returned, not raised, so a batch job keeps the other requests' results."""
        outcomes: list = [None] * len(_listed(requests))
        prepared = []
        for i, request in enumerate(requests):
            try:
                prepared.append((i, self.prepare(request, kind)))
            except Exception as err:  # noqa: BLE001 - see above: this request's outcome
                outcomes[i] = err
        for i, outcome in self._execute(prepared):
            outcomes[i] = outcome
        return outcomes

    def _raising(self, requests: list, kind: str) -> list:
        """All checked before any compute, the first problem raised; then all run, the first failure raised."""
        for request in _listed(requests):
            request_kind(request, kind)
        prepared = list(enumerate(self.prepare(r, kind) for r in requests))
        outcomes = [outcome for _, outcome in self._execute(prepared)]
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return outcomes

    def _execute(self, prepared: list[tuple[int, Prepared]]) -> list[tuple[int, object]]:
        """Submit as the queue has room, step until all are done: (index, result or exception), in order given."""
        pending, futures, refused = deque(prepared), [], []
        scheduler = self._claim()
        while pending or not all(f.done() for _, f in futures):
            while pending and scheduler.has_room:
                i, one = pending.popleft()
                try:
                    futures.append((i, scheduler.submit(one, timeout_s=math.inf)))
                except Exception as err:  # noqa: BLE001 - e.g. more KV than the budget: this request's outcome
                    refused.append((i, err))
            if not scheduler.step() and scheduler.idle and pending:
                raise RuntimeError("the scheduler made no progress")  # a bug: never expected
        outcomes = refused
        for i, future in futures:
            error = future.exception()
            outcomes.append((i, error if error is not None else future.result()))
        return sorted(outcomes, key=lambda outcome: outcome[0])

    def _claim(self) -> Scheduler:
        if self.driver is not None and self.driver.healthy:
            raise RuntimeError("an AsyncEngine drives this engine: submit to it")
        if not self.scheduler.idle:
            raise RuntimeError("the synchronous API takes one caller at a time")
        return self.scheduler


def _listed(requests) -> list:
    if not isinstance(requests, list | tuple):
        raise InvalidRequestError("requests", f"expected a list of requests, got {type(requests).__name__}")
    return requests


def heads_of(directory: ModelDir) -> HeadShape | None:
    """A decoder's attention shape, which its plan's prefill kernel is measured on (an HSTU has no such call)."""
    if directory.family != "qwen3":
        return None
    c = directory.config
    return HeadShape(c.num_attention_heads, c.num_key_value_heads, c.head_dim)


def _dtype(name: str | None, device: str) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return getattr(torch, name)
