"""Multi-candidate scoring, host side: what to score and how rows pack into passes (the runner runs them).

Every candidate is a row over its request's shared ContextKV, all in one pass.

Each candidate's tokens see the prompt (through the shared context) and themselves (causal), nothing else,
at positions that continue the prompt: its score is exactly what it would be if it alone followed the prompt.
Rows a job asks for (recommend's given candidates under rank_by="joint") also get log P(their tokens | prompt),
from the same pass: what beam search would have scored them with.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from genrec.model.kv_pool import ContextKV


@dataclass
class ScoreJob:
    """One request's candidates (token lists) against its context, with (positive, negative) label IDs.

    `sequence_from`: candidates from this index on also get their sequence log-probability, whose first token
    is read from `prompt_logprobs` [vocab] (the log-softmax after the prompt: the context holds no logits).
    """

    ctx: ContextKV
    candidates: list[list[int]]
    labels: tuple[int, int]
    sequence_from: int | None = None
    prompt_logprobs: torch.Tensor | None = None

    def __post_init__(self):
        if self.sequence_from is not None and self.prompt_logprobs is None:
            raise ValueError("sequence_from needs prompt_logprobs")

    def after(self, done: int) -> ScoreJob:
        """The same job without its first `done` candidates (those scored in earlier passes)."""
        first = None if self.sequence_from is None else max(self.sequence_from - done, 0)
        return ScoreJob(self.ctx, self.candidates[done:], self.labels, first, self.prompt_logprobs)


@dataclass
class LabelScores:
    logprob: torch.Tensor  # [N] full-vocabulary log-softmax of the positive label
    prob: torch.Tensor  # [N] softmax over the two labels: P(positive)
    sequence: torch.Tensor  # [N] log P(candidate tokens | prompt) for the rows asked for, NaN for the others

    @classmethod
    def empty(cls, device) -> LabelScores:
        return cls(*(torch.empty(0, device=device) for _ in range(3)))

    def __len__(self) -> int:
        return len(self.logprob)

    @classmethod
    def cat(cls, parts: list[LabelScores]) -> LabelScores:
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("logprob", "prob", "sequence")))


@dataclass
class Segment:
    """Candidates `start` to `start + len(candidates)` of `job`."""

    job: ScoreJob
    start: int
    candidates: list[list[int]]

    def wants_sequence(self) -> np.ndarray:
        """[rows] whether each row wants its sequence log-probability."""
        first = self.job.sequence_from
        return self.start + np.arange(len(self.candidates)) >= (first if first is not None else np.inf)


@dataclass
class Chunk:
    job_index: list[int]  # which job each segment belongs to
    segments: list[Segment]


def chunks(jobs: list[ScoreJob], max_tokens: int):
    """Split the candidates of all jobs into passes of at most `max_tokens` padded tokens, in order."""
    chunk, rows, longest = Chunk([], []), 0, 0
    for index, job in enumerate(jobs):
        start = 0
        for i, cand in enumerate(job.candidates):
            widest = max(longest, len(cand))
            if rows and (rows + 1) * widest > max_tokens:
                if i > start:
                    chunk.job_index.append(index)
                    chunk.segments.append(Segment(job, start, job.candidates[start:i]))
                yield chunk
                chunk, rows, widest, start = Chunk([], []), 0, len(cand), i
            rows, longest = rows + 1, widest
        if start < len(job.candidates):  # a job of no rows adds no segment: zero rows never reach attention
            chunk.job_index.append(index)
            chunk.segments.append(Segment(job, start, job.candidates[start:]))
    if chunk.segments:
        yield chunk


def pad_rows(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded [rows, longest] token matrix and the lengths (host), by one scatter (no loop per candidate)."""
    lengths = np.array([len(r) for r in rows])
    flat = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    row, col = ragged(lengths)
    ids = np.zeros((len(rows), int(lengths.max())), dtype=np.int64)
    ids[row, col] = flat
    return ids, lengths


def ragged(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of every element of rows of these lengths, row by row, without a loop per row."""
    row = np.repeat(np.arange(len(lengths)), lengths)
    return row, np.arange(len(row)) - np.repeat(lengths.cumsum() - lengths, lengths)


def score_job(prepared, ctx: ContextKV, last_logits: torch.Tensor, retrieved=None) -> ScoreJob:
    """A request's rows to score: its given candidates (score); for a recommend, the retrieved items, then the
    given candidates beam search did not find. Joint ranking also asks for the given ones' code logprob (the
    retrieved ones have theirs from the beam)."""
    if retrieved is None:
        return ScoreJob(ctx, prepared.candidate_tokens, prepared.labels)
    given = [prepared.candidate_tokens[k] for k in not_retrieved(prepared, retrieved)]
    tokens = [i.semantic_id for i in retrieved.items] + given
    if prepared.request.rank_by != "joint" or not given:
        return ScoreJob(ctx, tokens, prepared.labels)
    prompt_logprobs = torch.log_softmax(last_logits.float(), dim=-1)
    return ScoreJob(ctx, tokens, prepared.labels, len(retrieved.items), prompt_logprobs)


def not_retrieved(prepared, retrieved) -> list[int]:
    """Indices of the given candidates that beam search did not already find (those are ranked once)."""
    found = {i.item_id for i in retrieved.items}
    return [k for k, c in enumerate(prepared.given) if c.item_id is None or c.item_id not in found]
