"""The HSTU ranker as an engine family: rank (docs/engine.md, 'Ranking after a history: HSTU'). The context is
the event history (item row, action, time bucket, absolute positions); each candidate is a row at the position
after it, with no action and the unknown time bucket, seeing the history and itself only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from genrec.api import FAMILY_KINDS, Event, PromptForms, PromptResult, RankedItem, RankRequest, RankResult
from genrec.attention import ContextGroup
from genrec.catalog.catalog import ItemIndex
from genrec.engine.job import JobState, Prepared
from genrec.engine.pass_cost import PassCost
from genrec.engine.prefix_cache import Scope, block_keys
from genrec.engine.results import check_finite
from genrec.errors import InvalidRequestError
from genrec.model.ops import PLAIN_OPS, ModelOps
from genrec.staging import fetch, to_device


@dataclass
class PreparedHistory(Prepared):
    candidate_rows: np.ndarray | None = None  # the candidates' embedding rows
    candidate_ids: list[str] | None = None  # the candidates those rows are of (unknown ones skipped: fewer)
    tasks: list[int] | None = None  # the model's task indices to return, in order


class Ranker:
    name = "hstu"
    kinds = FAMILY_KINDS["hstu"]
    catalogs = None  # its item index is the model directory's: no catalog changes live

    def __init__(
        self,
        model,
        items: ItemIndex,
        max_candidates: int = 2048,
        score_max_tokens: int = 16384,
        ops: ModelOps = PLAIN_OPS,
        **_,
    ):
        """`score_max_tokens`: one ranking pass's bound in token-equivalents (genrec.engine.pass_cost). `ops`: the
        execution plan's. The decoder's own options (max_candidate_tokens, ...) are accepted, unused."""
        self.model, self.catalog, self.ops = model, items, ops
        self.device = model.device
        self.max_candidates = max_candidates
        self.score_max_tokens = score_max_tokens
        self.cost = PassCost.hstu(model.config, model.device.type)
        self.levels = 0  # nothing generates

    @classmethod
    def from_dir(cls, directory, device, dtype, **limits) -> Ranker:
        return cls(directory.load_model(device, dtype), directory.load_catalog(), **limits)

    def prepare(self, req: RankRequest, kind: str) -> PreparedHistory:
        """The history as event rows (item row, action, time bucket) and the candidates' rows, each checked: the
        history first, so that a bad one is refused even where no candidate is known (`_candidates`)."""
        config, items = self.model.config, self.catalog
        if len(req.history) > config.max_history_events:
            raise InvalidRequestError(
                "history", f"{len(req.history)} events exceed this model's limit of {config.max_history_events}"
            )
        if len(req.candidates) > self.max_candidates:
            raise InvalidRequestError(
                "candidates", f"{len(req.candidates)} candidates exceed this engine's limit of {self.max_candidates}"
            )
        rows = []
        for i, event in enumerate(req.history):
            row = items.row_of(event.item_id)
            if row is None:
                raise InvalidRequestError(f"history[{i}].item_id", f"unknown item {event.item_id!r}")
            if event.action is not None and not 0 <= event.action < config.num_actions:  # the schema may be bypassed
                raise InvalidRequestError(
                    f"history[{i}].action",
                    f"{event.action} is not an action of this model (0..{config.num_actions - 1})",
                )
            rows.append(row)
        actions = [config.no_action if e.action is None else e.action for e in req.history]
        if config.num_time_buckets:
            buckets = config.time_buckets([e.timestamp for e in req.history])
        else:
            buckets = [0] * len(req.history)
        candidate_ids, candidate_rows = self._candidates(req)
        tasks = list(range(len(config.tasks)))
        if req.tasks is not None:
            unknown = [(i, t) for i, t in enumerate(req.tasks) if t not in config.tasks]
            if unknown:
                i, task = unknown[0]
                raise InvalidRequestError(f"tasks[{i}]", f"{task!r} is not a task of this model {list(config.tasks)}")
            tasks = [config.tasks.index(t) for t in req.tasks]
        events = torch.tensor(np.stack([rows, actions, buckets], axis=1), dtype=torch.int64)
        return PreparedHistory(  # the pool holds the history alone: candidate rows attend to it, never written
            req, kind, events, len(events), scored_rows=len(candidate_rows), candidate_rows=candidate_rows,
            candidate_ids=candidate_ids, tasks=tasks,
        )  # fmt: skip

    def _candidates(self, req: RankRequest) -> tuple[list[str], np.ndarray]:
        """The candidates to rank and their rows, in order; an unknown one is refused, or left out with
        `unknown_candidates` 'skip' (the funnel's rule for items only its retriever knows, online and nightly)."""
        kept, rows = [], []
        for i, item in enumerate(req.candidates):
            row = self.catalog.row_of(item)
            if row is None:
                if req.unknown_candidates == "skip":
                    continue
                raise InvalidRequestError(f"candidates[{i}]", f"unknown item {item!r}")
            kept.append(item)
            rows.append(row)
        return kept, np.asarray(rows, dtype=np.int64)

    def render_prompt(self, req: PromptForms) -> PromptResult:
        """A ranker's context is a history: it has no prompt to show."""
        raise InvalidRequestError("request", f"this engine's model ({self.name}) takes no prompt")

    def block_keys(self, prepared: PreparedHistory, salt: bytes) -> list[bytes]:
        """Scoped by the request (its shared prefix counted in events)."""
        return block_keys(prepared.token_ids.numpy(), salt, None, None, Scope.of(prepared.request))

    def context_embeds(self, prepared: PreparedHistory, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Events [start, stop) (item, action, time bucket) at their absolute positions."""
        events = prepared.token_ids[start:stop]
        items, actions, buckets = (to_device(events[:, j].numpy(), self.device) for j in range(3))
        positions = to_device(np.arange(start, start + len(events)), self.device)
        with_buckets = buckets if self.model.config.num_time_buckets else None
        return self.model.embed_events(items, actions, positions, with_buckets)

    def prefill(self, segments: list, graphs=None) -> list[None]:
        """A history's K/V is all its candidates need: no outputs. (Not graphed: `capture_prefill`.)"""
        self.model.prefill_contexts(segments, self.ops)
        return [None] * len(segments)

    def capture_prefill(self, session, max_tokens: int, pool) -> None:
        """HSTU's prefill runs eagerly (its layers are few and short: launches cost little there)."""
        return None

    def start(self, job) -> JobState:
        return JobState.SCORING

    def rows_pass(self, jobs: list, budget: int) -> None:
        """One pass of candidate rows in order, within `budget` token-equivalents; a job all ranked gets its result."""
        model, device = self.model, self.device
        left = [(len(j.prepared.candidate_rows) - j.rows_done, self.cost.rows(1, 1, j.ctx.length)) for j in jobs]
        part = next(_row_chunks(left, budget), [])
        groups, items, positions, offset = [], [], [], 0
        for k, a, b in part:
            job = jobs[k]
            groups.append(ContextGroup(offset, offset + b - a, job.ctx))
            items.append(job.prepared.candidate_rows[job.rows_done + a : job.rows_done + b])
            positions.append(np.full(b - a, job.ctx.length))
            offset += b - a
        if part:
            items, positions = to_device(np.concatenate(items), device), to_device(np.concatenate(positions), device)
            probs = model.task_probs(
                model.candidates_over(model.embed_events(items, None, positions), groups, self.ops)
            )
            for (k, _, _), g in zip(part, groups, strict=True):
                job = jobs[k]
                job.scored.append(probs[g.start : g.stop][:, to_device(job.prepared.tasks, device)])
                job.rows_done += g.stop - g.start
        for job in jobs:
            if job.rows_done == len(job.prepared.candidate_rows):
                job.result = self._result(job.prepared, job.scored)

    def _result(self, prepared: PreparedHistory, scored: list[torch.Tensor]) -> RankResult:
        """The per-task probabilities in the candidates' order: one fetch, checked finite."""
        width = len(prepared.tasks)
        probs = torch.cat(scored) if scored else torch.empty(0, width, device=self.device)
        host = fetch(probs.double())
        check_finite(host.reshape(-1).tolist())
        names = [self.model.config.tasks[t] for t in prepared.tasks]
        items = [
            RankedItem(item_id=item, scores=dict(zip(names, row, strict=True)))
            for item, row in zip(prepared.candidate_ids, host.tolist(), strict=True)
        ]
        return RankResult(
            request_id=prepared.request.request_id,
            items=items,
            history_events=len(prepared.token_ids),
            catalog_version=self.catalog.version,
        )

    def warmup_requests(self) -> list:
        """A rank at two sizes (histories shorter than a prefix-cache block: nothing is cached)."""
        items, most = self.catalog.item_ids.tolist(), self.model.config.max_history_events
        history = [Event(item_id=items[0])]
        return [RankRequest(history=history * min(4 * size, most), candidates=items[:size]) for size in (2, 3)]

    def describe(self) -> dict:
        config = self.model.config
        return {
            "catalog_items": len(self.catalog),
            "catalog_version": self.catalog.version,
            "max_candidates": self.max_candidates,
            "tasks": list(config.tasks),
            "max_history_events": config.max_history_events,
        }


def _row_chunks(jobs: list[tuple[int, float]], budget: float):
    """Per pass within `budget` (or one row alone), (job, first, stop) pieces of jobs' (rows left, cost per row)."""
    part, used = [], 0.0
    for j, (n, each) in enumerate(jobs):
        a = 0
        while a < n:
            take = min(n - a, int((budget - used) // each))
            while take > 0 and used + take * each > budget:  # float rounding in the division
                take -= 1
            if take <= 0:
                if part:
                    yield part
                    part, used = [], 0.0
                    continue
                take = 1
            part.append((j, a, a + take))
            a, used = a + take, used + take * each
    if part:
        yield part
