"""Multi-candidate scoring: every candidate is a row over its request's shared ContextKV, all in one pass.

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

from genrec.attention import ContextGroup
from genrec.model.qwen3 import ContextKV, Qwen3
from genrec.staging import to_device


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


@dataclass
class LabelScores:
    logprob: torch.Tensor  # [N] full-vocabulary log-softmax of the positive label
    prob: torch.Tensor  # [N] softmax over the two labels: P(positive)
    sequence: torch.Tensor  # [N] log P(candidate tokens | prompt) for the rows asked for, NaN for the others

    @classmethod
    def cat(cls, parts: list[LabelScores]) -> LabelScores:
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("logprob", "prob", "sequence")))


def score_jobs(model: Qwen3, jobs: list[ScoreJob], max_tokens: int = 16384) -> list[LabelScores]:
    """Score every job's candidates; rows of many jobs share passes of at most `max_tokens` padded tokens.

    A job without candidates (a recommend that excluded everything) gets empty scores and no rows in any pass.
    """
    empty = LabelScores(*(torch.empty(0, device=model.device) for _ in range(3)))
    parts: list[list[LabelScores]] = [[empty] for _ in jobs]  # every job has a part, even with no rows
    for chunk in _chunks(jobs, max_tokens):
        for job_index, scores in zip(chunk.job_index, _score_chunk(model, chunk), strict=True):
            parts[job_index].append(scores)
    return [LabelScores.cat(ps) for ps in parts]


@dataclass
class _Segment:
    """Candidates `start` to `start + len(candidates)` of `job`."""

    job: ScoreJob
    start: int
    candidates: list[list[int]]

    def wants_sequence(self) -> np.ndarray:
        """[rows] whether each row wants its sequence log-probability."""
        first = self.job.sequence_from
        return self.start + np.arange(len(self.candidates)) >= (first if first is not None else np.inf)


@dataclass
class _Chunk:
    job_index: list[int]  # which job each segment belongs to
    segments: list[_Segment]


def _chunks(jobs: list[ScoreJob], max_tokens: int):
    """Split the candidates of all jobs into passes of at most `max_tokens` padded tokens, in order."""
    chunk, rows, longest = _Chunk([], []), 0, 0
    for index, job in enumerate(jobs):
        start = 0
        for i, cand in enumerate(job.candidates):
            widest = max(longest, len(cand))
            if rows and (rows + 1) * widest > max_tokens:
                if i > start:
                    chunk.job_index.append(index)
                    chunk.segments.append(_Segment(job, start, job.candidates[start:i]))
                yield chunk
                chunk, rows, widest, start = _Chunk([], []), 0, len(cand), i
            rows, longest = rows + 1, widest
        if start < len(job.candidates):  # a job of no rows adds no segment: zero rows never reach attention
            chunk.job_index.append(index)
            chunk.segments.append(_Segment(job, start, job.candidates[start:]))
    if chunk.segments:
        yield chunk


def _score_chunk(model: Qwen3, chunk: _Chunk) -> list[LabelScores]:
    device = model.device
    rows = [cand for seg in chunk.segments for cand in seg.candidates]
    ids, lengths = _pad(rows)
    counts = [len(seg.candidates) for seg in chunk.segments]
    groups, offset = [], 0
    for seg, n in zip(chunk.segments, counts, strict=True):
        groups.append(ContextGroup(offset, offset + n, seg.job.ctx))
        offset += n
    starts = np.repeat([seg.job.ctx.length for seg in chunk.segments], counts)
    positions = starts[:, None] + np.arange(ids.shape[1])[None, :]
    labels = np.repeat([seg.job.labels for seg in chunk.segments], counts, axis=0)
    ids_d, positions, labels = to_device(ids, device), to_device(positions, device), to_device(labels, device)
    hidden, _, _ = model.forward_rows(model.embed(ids_d), positions, groups, causal=True)
    last = hidden[torch.arange(len(rows), device=device), to_device(lengths - 1, device)]
    logprob, prob = _label_scores(model, last, labels[:, 0], labels[:, 1])
    sequence = _sequence_logprobs(model, chunk.segments, hidden, ids, lengths)
    out, offset = [], 0
    for n in counts:
        part = slice(offset, offset + n)
        out.append(LabelScores(logprob[part], prob[part], sequence[part]))
        offset += n
    return out


def _sequence_logprobs(model: Qwen3, segments: list[_Segment], hidden, ids: np.ndarray, lengths: np.ndarray):
    """[rows] log P(tokens | prompt) for the rows whose segment asks, NaN elsewhere. Token 0 is read from the
    job's prompt log-probs, token t > 0 from the row's own hidden state at t - 1."""
    device = hidden.device
    out = torch.full((len(ids),), float("nan"), device=device)
    wanted = np.flatnonzero(np.concatenate([seg.wants_sequence() for seg in segments]))
    if not len(wanted):
        return out
    asks = np.array([seg.job.sequence_from is not None for seg in segments])
    prompts = torch.stack([seg.job.prompt_logprobs for seg, a in zip(segments, asks, strict=True) if a])
    segment_of_row = np.repeat(np.arange(len(segments)), [len(seg.candidates) for seg in segments])
    prompt_of = (asks.cumsum() - 1)[segment_of_row[wanted]]  # its segment's row in `prompts`
    first = prompts[to_device(prompt_of, device), to_device(ids[wanted, 0], device)]
    # Tokens after the first, real ones only (no padding): (which wanted row, position of the state before it).
    owner, position = _ragged(lengths[wanted] - 1)
    before = hidden[to_device(wanted[owner], device), to_device(position, device)]
    picked = _token_logprobs(model, before, to_device(ids[wanted[owner], position + 1], device))
    total = first.index_add(0, to_device(owner, device), picked)
    return out.index_put((to_device(wanted, device),), total)


def _token_logprobs(model: Qwen3, hidden: torch.Tensor, tokens: torch.Tensor, rows: int = 512) -> torch.Tensor:
    """[N] log-softmax of each of `tokens` [N] under the logits of `hidden` [N, H], `rows` logit rows at a time."""
    parts = [
        torch.log_softmax(model.logits(h).float(), dim=-1).gather(1, t[:, None])[:, 0]
        for h, t in zip(hidden.split(rows), tokens.split(rows), strict=True)
    ]
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def _pad(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded [rows, longest] token matrix and the lengths (host), by one scatter (no loop per candidate)."""
    lengths = np.array([len(r) for r in rows])
    flat = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    row, col = _ragged(lengths)
    ids = np.zeros((len(rows), int(lengths.max())), dtype=np.int64)
    ids[row, col] = flat
    return ids, lengths


def _ragged(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of every element of rows of these lengths, row by row, without a loop per row."""
    row = np.repeat(np.arange(len(lengths)), lengths)
    return row, np.arange(len(row)) - np.repeat(lengths.cumsum() - lengths, lengths)


def _label_scores(model: Qwen3, last_hidden: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor, rows: int = 512):
    """Label log-probs without materialising [N, vocab] logits for all N at once."""
    logprobs, probs = [], []
    for h, p, n in zip(last_hidden.split(rows), pos.split(rows), neg.split(rows), strict=True):
        logits = model.logits(h)
        lse = torch.logsumexp(logits, dim=-1)
        pos_logit = logits.gather(1, p[:, None])[:, 0]
        neg_logit = logits.gather(1, n[:, None])[:, 0]
        logprobs.append(pos_logit - lse)
        probs.append(torch.sigmoid(pos_logit - neg_logit))
    return torch.cat(logprobs), torch.cat(probs)
