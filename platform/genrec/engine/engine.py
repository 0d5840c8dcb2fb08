"""The Engine: retrieve, score and recommend on one model. No Ray in here.

The synchronous methods submit their requests to the engine's own scheduler and step it until they are
done (the AsyncEngine steps the same scheduler from a background loop instead): one path for both.
"""

from __future__ import annotations

import math
from collections import deque
from pathlib import Path

import torch

from genrec.api import (
    RankRequest,
    RankResult,
    RecommendRequest,
    RecommendResult,
    RetrieveRequest,
    RetrieveResult,
    ScoreRequest,
    ScoreResult,
)
from genrec.catalog import Catalog, CodeTrie
from genrec.catalog.item_index import ItemIndex
from genrec.engine.checks import check_int
from genrec.engine.prepared import Prepared, check_kind, prepare
from genrec.engine.runner import ModelRunner
from genrec.engine.scheduler import Scheduler, SchedulerConfig
from genrec.errors import InvalidRequestError
from genrec.model import Qwen3, load_qwen3
from genrec.model.directory import GENREC_SUBDIR, ModelDirectory, directory_family, model_version
from genrec.model.family import family_of
from genrec.model.hstu import load_hstu
from genrec.model.soft_token import SoftTokenProjector
from genrec.model.tokenizer import USER_TOKEN, check_token_ids, load_tokenizer, semantic_token_ranges
from genrec.staging import host_side


class Engine:
    """Retrieve, score and recommend on one model. One caller at a time (the AsyncEngine serialises)."""

    def __init__(
        self,
        model: Qwen3,
        tokenizer,
        catalog: Catalog,
        projector: SoftTokenProjector | None = None,
        max_candidates: int = 2048,
        score_max_tokens: int = 16384,
        max_candidate_tokens: int = 65536,
        cuda_fast: bool = False,
        scheduler: SchedulerConfig | None = None,
        model_version: str = "",
    ):
        self.model = model
        self.family = family_of(model)
        self.tokenizer = tokenizer
        self.catalog = catalog  # a Catalog (item <-> semantic ID); for a ranking model an ItemIndex
        self.model_version = model_version  # salts the prefix cache's keys
        self.device = model.device
        self.projector = projector.to(self.device, model.dtype) if projector is not None else None
        self.max_candidates = check_int("max_candidates", max_candidates)
        self.score_max_tokens = check_int("score_max_tokens", score_max_tokens)  # one scoring pass, padded
        self.max_candidate_tokens = check_int("max_candidate_tokens", max_candidate_tokens)  # one request's
        if self.family == "qwen3":
            self.levels = catalog.levels
            self.trie = CodeTrie.build(catalog.codes, device=self.device)
            self.placeholder_id = tokenizer.get_vocab().get(USER_TOKEN)
            self.max_prompt_tokens = model.config.prompt_room(catalog.levels)  # room for the code after it
        else:
            self.levels, self.trie, self.placeholder_id = 0, None, None
            self.max_prompt_tokens = model.config.max_history_events
        self.runner = ModelRunner(model, self.levels, self.projector, self.placeholder_id, fast=bool(cuda_fast))
        self.scheduler_config = scheduler or SchedulerConfig()
        self._scheduler: Scheduler | None = None

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype | str | None = None, **options
    ):
        if dtype is None:
            dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if directory_family(model_dir) == "hstu":
            model = load_hstu(model_dir, device=device, dtype=dtype)
            items = ItemIndex.load(Path(model_dir) / GENREC_SUBDIR / "catalog.parquet", model.config.num_items)
            return cls(model, None, items, model_version=model_version(model_dir), **options)
        directory = ModelDirectory(model_dir)
        tokenizer = load_tokenizer(directory.path)
        check_token_ids(tokenizer, directory.config.vocab_size, directory.path)
        catalog = Catalog.load(directory.catalog_path, semantic_token_ranges(tokenizer))
        model = load_qwen3(directory.path, device=device, dtype=dtype)
        projector = None
        if directory.soft_token_path.exists():
            projector = SoftTokenProjector.load(directory.soft_token_path, model.config.hidden_size)
        return cls(model, tokenizer, catalog, projector, model_version=model_version(directory.path), **options)

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler the synchronous API steps, made (with its KV pool) on first use: an engine that only an
        AsyncEngine drives (which has its own) never allocates it."""
        if self._scheduler is None:
            self._scheduler = Scheduler(self, self.scheduler_config)
        return self._scheduler

    # -- batch API -------------------------------------------------------------------------------

    def retrieve(self, requests: list[RetrieveRequest]) -> list[RetrieveResult]:
        return self._run(requests, "retrieve")

    def score(self, requests: list[ScoreRequest]) -> list[ScoreResult]:
        """Each request's candidates in one pass over its single prefill."""
        return self._run(requests, "score")

    def recommend(self, requests: list[RecommendRequest]) -> list[RecommendResult]:
        """Beam search, then score the retrieved items plus the given candidates against the same ContextKV."""
        return self._run(requests, "recommend")

    def rank(self, requests: list[RankRequest]) -> list[RankResult]:
        """A ranking model (HSTU): each request's candidates after its history, every task's probability."""
        return self._run(requests, "rank")

    def prepare(self, req) -> Prepared:
        with host_side():  # request checks on host data, before any device work
            return prepare(self, req)

    def _run(self, requests, kind: str) -> list:
        """Every request checked (its kind, then its content) before any compute; then submitted as the queue
        has room, and the scheduler stepped until all are done. The first failure is raised."""
        if not isinstance(requests, list | tuple):
            raise InvalidRequestError("requests", f"expected a list of requests, got {type(requests).__name__}")
        for request in requests:
            check_kind(request, kind)
        pending = deque(self.prepare(r) for r in requests)
        scheduler, futures = self.scheduler, []
        if not scheduler.idle:
            raise RuntimeError("the synchronous API takes one caller at a time")
        while pending or not all(f.done() for f in futures):
            while pending and scheduler.has_room:
                futures.append(scheduler.submit(pending.popleft(), timeout_s=math.inf))
            if not scheduler.step() and scheduler.idle and pending:
                raise RuntimeError("the scheduler made no progress")  # a bug: never expected
        return [f.result() for f in futures]
