"""A request inside the scheduler: prepared (checked, on the host), its state, the moves allowed between states, and
what each state holds."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum

import torch

from genrec.api import RankRequest, RecommendRequest, RetrieveRequest, RetrieveResult, ScoreRequest
from genrec.engine.beam import BeamCohort
from genrec.engine.scoring import CandidateRows
from genrec.model.kv_pool import Holding


@dataclass
class Prepared:
    """A request checked against the model, as host tensors, before any compute (refusals name the field)."""

    request: RetrieveRequest | ScoreRequest | RecommendRequest | RankRequest
    kind: str
    # The context on the host, what the prefix cache keys: a prompt's token IDs [T] or events [T, 3], int64.
    token_ids: torch.Tensor
    kv_tokens: int = 0  # pool tokens it holds at its peak: its context, beam suffixes, candidate rows it writes
    scored_rows: int = 0  # rows computed over its context that write no pool token (a ranker's candidates)


class JobState(Enum):
    WAITING = "waiting"  # queued; holds nothing
    PREFILLING = "prefilling"  # holds its KV; its prompt runs in chunks after its reused prefix, ctx.length done
    DECODING = "decoding"  # generates over its context (beam search), one level per step
    SCORING = "scoring"  # rows over its context in bounded passes: its candidates (recommend: its beams too)
    FINISHED = "finished"  # its future is settled and its KV released


_MOVES = {
    JobState.WAITING: {JobState.PREFILLING, JobState.FINISHED},  # even a cached prompt prefills its last token
    JobState.PREFILLING: {JobState.DECODING, JobState.SCORING, JobState.FINISHED},
    JobState.DECODING: {JobState.SCORING, JobState.FINISHED},
    JobState.SCORING: {JobState.FINISHED},
    JobState.FINISHED: set(),
}


@dataclass(eq=False)
class Job:
    prepared: Prepared
    future: Future
    submitted: float
    deadline: float
    kv_tokens: int  # pool tokens it holds at its peak
    state: JobState = JobState.WAITING
    block_keys: list[bytes] | None = None  # its prompt's keys in the prefix cache, from admission on
    holding: Holding | None = None  # its extents of the pool, from admission until it finishes
    last_logits: torch.Tensor | None = None  # once prefilled
    cohort: BeamCohort | None = None  # DECODING
    retrieved: RetrieveResult | None = None  # SCORING a recommend: its beams, ranked with the given candidates
    row_of_retrieved: list[int] | None = None  # SCORING a recommend: each retrieved item's row (one per code)
    work: CandidateRows | None = None  # SCORING (score, recommend): its rows, built when it starts scoring
    scored: list = field(default_factory=list)  # SCORING: the outputs of its rows done so far, pass by pass
    rows_done: int = 0
    result: object | None = None  # what its future gets, once its family has built it

    @property
    def kind(self) -> str:
        return self.prepared.kind

    @property
    def ctx(self):
        return self.holding.ctx

    @property
    def finished(self) -> bool:
        return self.state is JobState.FINISHED

    def move(self, state: JobState) -> None:
        if state not in _MOVES[self.state]:
            raise RuntimeError(f"a job cannot move from {self.state.value} to {state.value}")
        self.state = state
