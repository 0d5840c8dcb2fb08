"""The model runner: runs the passes the scheduler decides, through the engine's family (genrec.engine.family).

- prefill: chunks of many contexts packed into one pass, each written into its ContextKV (an extent of the
  engine's KV pool) at the positions it continues from;
- decode (a generating family): one pass for the rows of many beam cohorts (any levels), its inputs as data in
  fixed buffers, so on CUDA with the `fast` option the pass replays as a captured graph per row bucket;
- rows: one bounded pass of the jobs' candidate rows over their contexts (scoring, or ranking).

Every pass runs under inference mode. `fast` selects the CUDA attention kernels and graphs; it is passed down,
never read from a global.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from genrec.engine.beam import BeamCohort, advance_all
from genrec.engine.decode_batch import DecodeBatch, bucket_of
from genrec.engine.family import Family, Prepared
from genrec.model.kv_pool import MAX_SPANS, ContextKV, KVPool


@dataclass
class Prefilled:
    """A context prefilled on its own: its ContextKV and the float32 outputs at its last position."""

    ctx: ContextKV
    last_logits: torch.Tensor | None


class ModelRunner:
    def __init__(self, family: Family, fast: bool = False):
        self.family, self.model = family, family.model
        self.device = self.model.device
        self.fast = fast
        self.graphs = fast and self.device.type == "cuda"  # static decode passes replayed as CUDA graphs
        self.past = max(family.levels - 2, 0)  # the longest beam suffix a decode pass reads
        self._buckets: dict[tuple[int, int], DecodeBatch] = {}  # (pool, bucket) -> what its graph reads
        self._captured: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._mempool = None

    def new_pool(self, tokens: int) -> KVPool:
        return KVPool(self.model.config, tokens, self.device, self.model.dtype)

    # -- prefill ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill_alone(self, prepared: Prepared) -> Prefilled:
        """One context in one pass, into a pool of its own: the plain prefill benchmarks take as their floor."""
        ctx = ContextKV.allocate(self.model.config, len(prepared.token_ids), self.device, self.model.dtype)
        (logits,) = self.prefill([(prepared, ctx, 0, len(prepared.token_ids))])
        return Prefilled(ctx, logits)

    @torch.inference_mode()
    def prefill(self, chunks: list[tuple[Prepared, ContextKV, int, int]]) -> list[torch.Tensor | None]:
        """Chunks (prepared, ctx, start, n): rows [start, start + n) of each context, in one packed pass, written
        into ctx. Returns the outputs at each chunk's last position. A retried pass rewrites the same positions."""
        segments = []
        for prepared, ctx, start, n in chunks:
            ctx.length = start
            segments.append((self.family.context_embeds(prepared, start, start + n), ctx))
        return self.family.prefill(segments)

    # -- decode ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, cohorts: list[BeamCohort], bucketed: bool | None = None) -> None:
        """One pass for every row of the cohorts (any levels; their contexts and BeamKV slots in one pool), then
        each cohort's selection. `bucketed` (default: with CUDA graphs) pads the rows to a power of two, the
        shape a captured graph replays; else the pass is sized to the rows."""
        # Same-level cohorts of one catalog version adjacent: one selection each (beam.advance_all).
        cohorts = sorted(cohorts, key=lambda c: (c.level, id(c.trie)))
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
        return self.family.decode_forward(batch)

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

    # -- rows ------------------------------------------------------------------------------------

    @torch.inference_mode()
    def rows_pass(self, jobs: list, budget: int) -> None:
        """One bounded pass of the jobs' next rows (scoring or ranking); finished jobs get their result."""
        self.family.rows_pass(jobs, budget)
