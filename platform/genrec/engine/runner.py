"""The model runner: the one place that calls the model. The scheduler decides what runs; this runs it.

- prefill: chunks of many prompts packed into one pass, each written into its ContextKV (an extent of the
  engine's KV pool) at the positions it continues from;
- decode: one pass for the rows of many beam cohorts (any levels), its inputs as data in fixed buffers, so on
  CUDA with the `fast` option the pass replays as a captured graph per row bucket;
- score: candidate rows over their requests' contexts, in passes of bounded size, read out as label scores
  and (where asked) sequence log-probabilities.

The model is any `genrec.model.family.ContextModel` (Qwen3 here): embed, prefill_packed, forward_rows, logits.
`fast` selects the CUDA attention kernels and graphs; it is passed down, never read from a global.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from genrec.attention import ContextGroup, ContextRows
from genrec.engine.beam import BeamCohort, advance_all
from genrec.engine.decode_batch import DecodeBatch, bucket_of
from genrec.engine.prepared import Prepared
from genrec.engine.scoring import LabelScores, ScoreJob, Segment, chunks, pad_rows, ragged
from genrec.engine.soft_token import inject_user_embedding
from genrec.model.kv_pool import MAX_SPANS, ContextKV, KVPool
from genrec.staging import to_device


@dataclass
class Prefilled:
    """A prompt prefilled on its own: its ContextKV and the float32 logits at its last position."""

    ctx: ContextKV
    last_logits: torch.Tensor


class ModelRunner:
    def __init__(self, model, levels: int, projector=None, placeholder_id: int | None = None, fast: bool = False):
        self.model, self.projector, self.placeholder_id = model, projector, placeholder_id
        self.ranks = hasattr(model, "candidates_over")  # the HSTU family: histories and candidate rows
        self.device = model.device
        self.fast = fast
        self.graphs = fast and self.device.type == "cuda"  # static decode passes replayed as CUDA graphs
        self.past = max(levels - 2, 0)  # the longest beam suffix a decode pass reads
        self._buckets: dict[tuple[int, int], DecodeBatch] = {}  # (pool, bucket) -> what its graph reads
        self._captured: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._mempool = None

    def new_pool(self, tokens: int) -> KVPool:
        return KVPool(self.model.config, tokens, self.device, self.model.dtype)

    # -- prefill ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def prompt_embeds(self, prepared: Prepared, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Input embeddings of context rows [start, stop): prompt tokens, the soft token injected where the request
        has one; or a history's events (item, action, time bucket at their absolute positions)."""
        if prepared.kind == "rank":
            return self._event_embeds(prepared.token_ids[start:stop], start)
        ids = prepared.token_ids[start:stop]
        embeds = self.model.embed(to_device(ids.numpy(), self.device))
        vector = prepared.request.user_embedding
        if vector is None:
            return embeds
        return inject_user_embedding(embeds, ids, self.placeholder_id, vector, self.projector)

    @torch.inference_mode()
    def prefill_alone(self, prepared: Prepared) -> Prefilled:
        """One prompt in one pass, into a pool of its own: the plain prefill benchmarks take as their floor."""
        ctx = ContextKV.allocate(self.model.config, len(prepared.token_ids), self.device, self.model.dtype)
        (logits,) = self.prefill([(prepared, ctx, 0, len(prepared.token_ids))])
        return Prefilled(ctx, logits)

    @torch.inference_mode()
    def prefill(self, chunks: list[tuple[Prepared, ContextKV, int, int]]) -> torch.Tensor:
        """Chunks (prepared, ctx, start, n): tokens [start, start + n) of each prompt, in one packed pass, written
        into ctx. Returns the logits at each chunk's last position [chunks, vocab]. A retried pass rewrites
        the same positions."""
        segments = []
        for prepared, ctx, start, n in chunks:
            ctx.length = start
            segments.append((self.prompt_embeds(prepared, start, start + n), ctx))
        if self.ranks:  # a history: its K/V is all the candidates need
            self.model.prefill_contexts(segments)
            return [None] * len(segments)
        return self.model.prefill_packed(segments, fast=self.fast)

    # -- decode ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, cohorts: list[BeamCohort], bucketed: bool | None = None) -> None:
        """One pass for every row of the cohorts (any levels; their contexts and BeamKV slots in one pool), then
        each cohort's selection. `bucketed` (default: with CUDA graphs) pads the rows to a power of two, the
        shape a captured graph replays; else the pass is sized to the rows."""
        cohorts = sorted(cohorts, key=lambda c: c.level)  # same-level cohorts adjacent: one selection each
        pool = cohorts[0].slot_pool
        rows = sum(c.rows for c in cohorts)
        bucketed = self.graphs if bucketed is None else bucketed
        if bucketed:
            batch = self._bucket(pool, bucket_of(rows))
        else:
            spans = max(len(ctx.spans()) for c in cohorts for ctx in c.contexts)
            batch = DecodeBatch(rows, self.past, pool, spans, self.fast)
        batch.fill(cohorts)
        logprobs, new_k, new_v = self._replay(batch) if bucketed and self.graphs else self.decode_forward(batch)
        advance_all(cohorts, logprobs[:rows], new_k[:, :rows], new_v[:, :rows])

    def decode_forward(self, batch: DecodeBatch):
        """The pass over a filled batch: (logprobs [B, vocab], new_k, new_v [layers, B, 1, kv_heads, hd])."""
        model, pool = self.model, batch.pool
        past_k = pool.k[:, batch.ancestors] if batch.past else None  # [layers, B, P, KV, D]: one gather
        past_v = pool.v[:, batch.ancestors] if batch.past else None
        embeds = model.embed(batch.tokens[:, None])
        hidden, new_k, new_v = model.forward_rows(
            embeds, batch.positions[:, None], batch.context, past_k, past_v, mask=batch.mask
        )
        return torch.log_softmax(model.logits(hidden[:, -1]), dim=-1), new_k, new_v

    def _bucket(self, pool: KVPool, bucket: int) -> DecodeBatch:
        """The bucket's batch, kept: a captured graph reads its buffers at replay."""
        key = (id(pool), bucket)
        if key not in self._buckets:
            self._buckets[key] = DecodeBatch(bucket, self.past, pool, MAX_SPANS, self.fast)
        return self._buckets[key]

    def _replay(self, batch: DecodeBatch):
        key = (id(batch.pool), batch.bucket)
        graph = self._captured.get(key)
        if graph is None:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.decode_forward(batch)  # warm-up outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            self._mempool = self._mempool or torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._mempool):
                batch.outputs = self.decode_forward(batch)
            self._captured[key] = graph
        graph.replay()
        return batch.outputs

    # -- ranking (HSTU) ---------------------------------------------------------------------------

    def _event_embeds(self, events: torch.Tensor, start: int) -> torch.Tensor:
        """events [n, 3] (item row, action, bucket) on the host, at positions start .. start + n - 1."""
        device = self.device
        items, actions, buckets = (to_device(events[:, j].numpy(), device) for j in range(3))
        positions = to_device(np.arange(start, start + len(events)), device)
        return self.model.embed_events(
            items, actions, positions, buckets if self.model.config.num_time_buckets else None
        )

    @torch.inference_mode()
    def rank_pass(self, jobs: list[tuple[ContextKV, np.ndarray, list[int]]], max_rows: int):
        """One pass of at most `max_rows` candidate rows, taken in order from the jobs (history ctx, candidate rows
        still to rank, task indices): (job index, [rows, tasks] probabilities of its next rows) per job reached.
        A candidate takes the position after the history, no action and the unknown time bucket; it sees the
        history and itself only, so it scores the same whatever else is ranked with it."""
        model, device = self.model, self.device
        part = next(_row_chunks([len(rows) for _, rows, _ in jobs], max_rows), [])
        if not part:
            return []
        groups, items, positions, offset = [], [], [], 0
        for j, a, b in part:
            ctx = jobs[j][0]
            groups.append(ContextGroup(offset, offset + b - a, ctx))
            items.append(jobs[j][1][a:b])
            positions.append(np.full(b - a, ctx.length))
            offset += b - a
        items, positions = to_device(np.concatenate(items), device), to_device(np.concatenate(positions), device)
        probs = model.task_probs(model.candidates_over(model.embed_events(items, None, positions), groups))
        return [
            (j, probs[g.start : g.stop][:, to_device(jobs[j][2], device)])
            for (j, _, _), g in zip(part, groups, strict=True)
        ]

    # -- scoring ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def score_pass(self, jobs: list[ScoreJob], max_tokens: int) -> list[tuple[int, LabelScores]]:
        """One pass of at most `max_tokens` padded tokens, candidates taken in order from the jobs: (job index,
        scores of its next rows) per job reached. Every candidate is a row over its job's context."""
        chunk = next(chunks(jobs, max_tokens), None)
        if chunk is None:
            return []
        return list(zip(chunk.job_index, self._score_chunk(chunk.segments), strict=True))

    def score(self, jobs: list[ScoreJob], max_tokens: int) -> list[LabelScores]:
        """Every job's candidates, pass after pass (what the scheduler spreads over its steps)."""
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
        context = ContextRows(groups, len(ids), ids.shape[1], fast=self.fast)
        hidden, _, _ = model.forward_rows(model.embed(ids_d), positions, context, causal=True)
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


def _row_chunks(counts: list[int], max_rows: int):
    """Rows of many jobs in order, cut into passes of at most `max_rows`: per pass, (job, first, stop) pieces."""
    part, used = [], 0
    for j, n in enumerate(counts):
        a = 0
        while a < n:
            take = min(n - a, max_rows - used)
            part.append((j, a, a + take))
            a, used = a + take, used + take
            if used == max_rows:
                yield part
                part, used = [], 0
    if part:
        yield part
