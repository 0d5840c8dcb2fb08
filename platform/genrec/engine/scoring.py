"""Multi-candidate scoring: every candidate is a row over its request's shared ContextKV, all in one pass.

Each candidate's tokens see the prompt (through the shared context) and themselves (causal), nothing else,
at positions that continue the prompt: its score is exactly what it would be if it alone followed the prompt.
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
    """One request's candidates (token lists) against its context, with (positive, negative) label IDs."""

    ctx: ContextKV
    candidates: list[list[int]]
    labels: tuple[int, int]


@dataclass
class LabelScores:
    logprob: torch.Tensor  # [N] full-vocabulary log-softmax of the positive label
    prob: torch.Tensor  # [N] softmax over the two labels: P(positive)


def score_jobs(model: Qwen3, jobs: list[ScoreJob], max_tokens: int = 16384) -> list[LabelScores]:
    """Score every job's candidates; rows of many jobs share passes of at most `max_tokens` padded tokens.

    A job without candidates (a recommend that excluded everything) gets empty scores and no rows in any pass.
    """
    empty = LabelScores(torch.empty(0, device=model.device), torch.empty(0, device=model.device))
    parts: list[list[LabelScores]] = [[empty] for _ in jobs]  # every job has a part, even with no rows
    for chunk in _chunks(jobs, max_tokens):
        for job_index, scores in zip(chunk.job_index, _score_chunk(model, chunk), strict=True):
            parts[job_index].append(scores)
    return [LabelScores(torch.cat([p.logprob for p in ps]), torch.cat([p.prob for p in ps])) for ps in parts]


@dataclass
class _Chunk:
    job_index: list[int]  # which job each segment belongs to
    segments: list[tuple[ContextKV, list[list[int]], tuple[int, int]]]


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
                    chunk.segments.append((job.ctx, job.candidates[start:i], job.labels))
                yield chunk
                chunk, rows, widest, start = _Chunk([], []), 0, len(cand), i
            rows, longest = rows + 1, widest
        if start < len(job.candidates):  # a job of no rows adds no segment: zero rows never reach attention
            chunk.job_index.append(index)
            chunk.segments.append((job.ctx, job.candidates[start:], job.labels))
    if chunk.segments:
        yield chunk


def _score_chunk(model: Qwen3, chunk: _Chunk) -> list[LabelScores]:
    device = model.device
    rows = [cand for _, cands, _ in chunk.segments for cand in cands]
    ids, lengths = _pad(rows)
    counts = [len(cands) for _, cands, _ in chunk.segments]
    groups, offset = [], 0
    for (ctx, _, _), n in zip(chunk.segments, counts, strict=True):
        groups.append(ContextGroup(offset, offset + n, ctx))
        offset += n
    starts = np.repeat([ctx.length for ctx, _, _ in chunk.segments], counts)
    positions = starts[:, None] + np.arange(ids.shape[1])[None, :]
    labels = np.repeat([labels for _, _, labels in chunk.segments], counts, axis=0)
    ids, positions, labels = to_device(ids, device), to_device(positions, device), to_device(labels, device)
    hidden, _, _ = model.forward_rows(model.embed(ids), positions, groups, causal=True)
    last = hidden[torch.arange(len(rows), device=device), to_device(lengths - 1, device)]
    logprob, prob = _label_scores(model, last, labels[:, 0], labels[:, 1])
    out, offset = [], 0
    for _, cands, _ in chunk.segments:
        out.append(LabelScores(logprob[offset : offset + len(cands)], prob[offset : offset + len(cands)]))
        offset += len(cands)
    return out


def _pad(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded [rows, longest] token matrix and the lengths (host), by one scatter (no loop per candidate)."""
    lengths = np.array([len(r) for r in rows])
    flat = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    row = np.repeat(np.arange(len(rows)), lengths)
    col = np.arange(len(flat)) - np.repeat(lengths.cumsum() - lengths, lengths)
    ids = np.zeros((len(rows), int(lengths.max())), dtype=np.int64)
    ids[row, col] = flat
    return ids, lengths


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
