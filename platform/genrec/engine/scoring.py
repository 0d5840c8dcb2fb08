"""Multi-candidate scoring: what to score, how rows pack into cost-bounded passes, and the scoring pass (docs/engine.md,
'score'). Each candidate is a row over its request's ContextKV, seeing the prompt and itself (causal) at positions
that continue it. Rows a job asks for (recommend's given candidates under rank_by="joint") also get
log P(their tokens | prompt) from the same pass: what beam search would have scored them with.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from genrec.attention import ContextGroup, ContextRows
from genrec.engine.pass_cost import PassCost
from genrec.model.kv_pool import ContextKV
from genrec.model.ops import PLAIN_OPS, ModelOps
from genrec.staging import to_device


@dataclass
class CandidateRows:
    """One request's candidates (token lists) against its context, with (positive, negative) label IDs.
    `sequence_from`: candidates from here on also get their sequence log-probability, the first token's read from
    `prompt_logprobs` [vocab] (the context holds no logits)."""

    ctx: ContextKV
    candidates: list[list[int]]
    labels: tuple[int, int]
    sequence_from: int | None = None
    prompt_logprobs: torch.Tensor | None = None

    def __post_init__(self):
        if self.sequence_from is not None and self.prompt_logprobs is None:
            raise ValueError("sequence_from needs prompt_logprobs")

    def after(self, done: int) -> CandidateRows:
        """The same job without its first `done` candidates (those scored in earlier passes)."""
        first = None if self.sequence_from is None else max(self.sequence_from - done, 0)
        return CandidateRows(self.ctx, self.candidates[done:], self.labels, first, self.prompt_logprobs)


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

    def rows(self, index: torch.Tensor) -> LabelScores:
        """These scores at `index` (rows repeated or reordered: e.g. one per item of a shared code)."""
        return LabelScores(self.logprob[index], self.prob[index], self.sequence[index])

    @classmethod
    def cat(cls, parts: list[LabelScores]) -> LabelScores:
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("logprob", "prob", "sequence")))


@dataclass
class Segment:
    """Candidates `start` to `start + len(candidates)` of `job`."""

    job: CandidateRows
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


def chunks(jobs: list[CandidateRows], budget: float, cost: PassCost):
    """All jobs' candidates in passes, in order, each within `budget` by `cost` (or one row alone)."""
    chunk, rows, longest, keys = Chunk([], []), 0, 0, 0
    for index, job in enumerate(jobs):
        start, context = 0, job.ctx.length
        for i, cand in enumerate(job.candidates):
            widest = max(longest, len(cand))
            if rows and cost.rows(rows + 1, widest, keys + context) > budget:
                if i > start:
                    chunk.job_index.append(index)
                    chunk.segments.append(Segment(job, start, job.candidates[start:i]))
                yield chunk
                chunk, rows, widest, keys, start = Chunk([], []), 0, len(cand), 0, i
            rows, longest, keys = rows + 1, widest, keys + context
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


def candidate_rows(
    prepared, ctx: ContextKV, last_logits: torch.Tensor, retrieved=None, retrieved_rows=None
) -> CandidateRows:
    """A request's rows: its given candidates; for a recommend, `retrieved_rows`, then the given ones not retrieved
    (under joint ranking these also ask for their code logprob; the retrieved have theirs from the beam)."""
    if retrieved is None:
        return CandidateRows(ctx, prepared.candidate_tokens, prepared.labels)
    given = [prepared.candidate_tokens[k] for k in not_retrieved(prepared, retrieved)]
    tokens = list(retrieved_rows) + given
    if prepared.request.rank_by != "joint" or not given:
        return CandidateRows(ctx, tokens, prepared.labels)
    prompt_logprobs = torch.log_softmax(last_logits.float(), dim=-1)
    return CandidateRows(ctx, tokens, prepared.labels, len(retrieved_rows), prompt_logprobs)


def not_retrieved(prepared, retrieved) -> list[int]:
    """Indices of the given candidates that beam search did not already find (those are ranked once)."""
    found = {i.item_id for i in retrieved.items}
    return [k for k, c in enumerate(prepared.given) if c.item_id is None or c.item_id not in found]


class Scorer:
    """Runs scoring passes on a Qwen3 model: every candidate a row over its job's context, causal within itself."""

    def __init__(self, model, ops: ModelOps = PLAIN_OPS):
        self.model, self.device, self.ops = model, model.device, ops
        self.cost = PassCost.qwen3(model.config)

    @torch.inference_mode()
    def score_pass(self, jobs: list[CandidateRows], max_tokens: float) -> list[tuple[int, LabelScores]]:
        """One pass within `max_tokens` token-equivalents: (job index, scores of its next rows) per job reached."""
        chunk = next(chunks(jobs, max_tokens, self.cost), None)
        if chunk is None:
            return []
        return list(zip(chunk.job_index, self._score_chunk(chunk.segments), strict=True))

    def score(self, jobs: list[CandidateRows], max_tokens: float) -> list[LabelScores]:
        """Every job's candidates, pass after pass (the scheduler spreads these over its steps)."""
        parts: list[list[LabelScores]] = [[LabelScores.empty(self.device)] for _ in jobs]
        done = [0] * len(jobs)
        while pending := [i for i, job in enumerate(jobs) if done[i] < len(job.candidates)]:
            for k, scores in self.score_pass([jobs[i].after(done[i]) for i in pending], max_tokens):
                parts[pending[k]].append(scores)
                done[pending[k]] += len(scores)
        return [LabelScores.cat(ps) for ps in parts]

    def _score_chunk(self, segments: list[Segment]) -> list[LabelScores]:
        model, device = self.model, self.device
        ids, lengths = pad_rows([cand for seg in segments for cand in seg.candidates])
        counts = [len(seg.candidates) for seg in segments]
        groups, offset = [], 0
        for seg, n in zip(segments, counts, strict=True):
            groups.append(ContextGroup(offset, offset + n, seg.job.ctx))
            offset += n
        starts = np.repeat([seg.job.ctx.length for seg in segments], counts)
        positions = starts[:, None] + np.arange(ids.shape[1])[None, :]
        labels = np.repeat([seg.job.labels for seg in segments], counts, axis=0)
        ids_d, positions, labels = to_device(ids, device), to_device(positions, device), to_device(labels, device)
        context = ContextRows(groups, len(ids), ids.shape[1], self.ops.attention)
        hidden, _, _ = model.forward_rows(model.embed(ids_d), positions, context, causal=True, ops=self.ops)
        last = hidden[torch.arange(len(ids), device=device), to_device(lengths - 1, device)]
        logprob, prob = self._label_scores(last, labels[:, 0], labels[:, 1])
        sequence = self._sequence_logprobs(segments, hidden, ids, lengths)
        out, offset = [], 0
        for n in counts:
            part = slice(offset, offset + n)
            out.append(LabelScores(logprob[part], prob[part], sequence[part]))
            offset += n
        return out

    def _sequence_logprobs(self, segments: list[Segment], hidden, ids: np.ndarray, lengths: np.ndarray):
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
        owner, position = ragged(lengths[wanted] - 1)
        before = hidden[to_device(wanted[owner], device), to_device(position, device)]
        picked = self._token_logprobs(before, to_device(ids[wanted[owner], position + 1], device))
        total = first.index_add(0, to_device(owner, device), picked)
        return out.index_put((to_device(wanted, device),), total)

    def _token_logprobs(self, hidden: torch.Tensor, tokens: torch.Tensor, rows: int = 512) -> torch.Tensor:
        """[N] log-softmax of each of `tokens` [N] under the logits of `hidden` [N, H], `rows` logit rows at a time."""
        parts = [
            torch.log_softmax(self.model.logits(h).float(), dim=-1).gather(1, t[:, None])[:, 0]
            for h, t in zip(hidden.split(rows), tokens.split(rows), strict=True)
        ]
        return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)

    def _label_scores(self, last_hidden: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor, rows: int = 512):
        """Label log-probs without materialising [N, vocab] logits for all N at once."""
        logprobs, probs = [], []
        for h, p, n in zip(last_hidden.split(rows), pos.split(rows), neg.split(rows), strict=True):
            logits = self.model.logits(h)
            lse = torch.logsumexp(logits, dim=-1)
            pos_logit = logits.gather(1, p[:, None])[:, 0]
            neg_logit = logits.gather(1, n[:, None])[:, 0]
            logprobs.append(pos_logit - lse)
            probs.append(torch.sigmoid(pos_logit - neg_logit))
        return torch.cat(logprobs), torch.cat(probs)
