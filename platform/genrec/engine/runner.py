"""The model runner: runs the passes the scheduler decides (prefill chunks, decode, rows), through the engine's
family, as the engine's execution plan says (genrec.engine.plan). With the plan's graphs, decode replays a graph per
row bucket, sequence capacity and span count, all captured once at engine start (`capture`), never on a live request;
a pass the captures do not hold runs eagerly.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch

from genrec.engine.beam import BeamCohort
from genrec.engine.capture_size import decode_bytes_per_row, rows_to_capture
from genrec.engine.decode_batch import DecodeBatch, bucket_of
from genrec.engine.family import Family
from genrec.engine.job import Prepared
from genrec.engine.plan import SPLIT_MIN_CHUNK, ExecutionPlan
from genrec.engine.selection import advance_all, choices
from genrec.model.kv_pool import MAX_SPANS, ContextKV, KVPool


@dataclass
class Prefilled:
    """A context prefilled on its own: its ContextKV and the float32 outputs at its last position."""

    ctx: ContextKV
    last_logits: torch.Tensor | None


class ModelRunner:
    def __init__(self, family: Family, plan: ExecutionPlan, graph_max_rows: int | None = None, max_requests: int = 8):
        """`graph_max_rows`: the largest decode pass captured at start (None: worked out as it captures,
        genrec.engine.capture_size); `max_requests`: the most requests one decode pass holds (the scheduler's
        `max_running`); the scheduler keeps passes within both (`pass_holds`)."""
        # torch's compiler, which the attention's custom ops import on their first call: here, as the engine loads,
        # not in its first request (a process that only checks a model directory never imports it).
        import torch._dynamo  # noqa: F401

        self.family, self.model, self.plan = family, family.model, plan
        self.device = self.model.device
        self.graphs = plan.graphs
        self.graph_max_rows = None if graph_max_rows is None else bucket_of(graph_max_rows)
        self.max_requests = max_requests
        self.past = max(family.levels - 2, 0)  # the longest beam suffix a decode pass reads
        self._buckets: dict[tuple, DecodeBatch] = {}  # (pool, bucket, spans, capacity, columns) -> a pass (no graph)
        self._captured: dict[tuple, tuple[DecodeBatch, object]] = {}  # (pool, bucket, spans, capacity) -> pass, graph
        self.warmup_s: float | None = None  # how long `capture` and the engine's warm-up requests took
        self.graph_bytes: int | None = None  # the device memory the captures took (None: none captured)
        self.uncaptured_passes = 0  # bucketed passes that found no captured graph (ran eagerly; none expected)
        self.prefill_graphs = None  # the prefill's stages per token bucket, once captured

    def new_pool(self, tokens: int) -> KVPool:
        return KVPool(self.model.config, tokens, self.device, self.model.dtype)

    @torch.inference_mode()
    def prefill_alone(self, prepared: Prepared) -> Prefilled:
        """One context in one pass, into a pool of its own: the plain prefill benchmarks take as their floor. With
        prefill graphs (which write the engine's pool), the pass runs in the engine's pool where it has room, its K/V
        then copied to the context's own pool and the engine's tokens given back. Not while the engine runs."""
        n = len(prepared.token_ids)
        ctx = ContextKV.allocate(self.model.config, n, self.device, self.model.dtype)
        staged = None if self.prefill_graphs is None else self.prefill_graphs.pool.context(n)
        if staged is None:
            (logits,) = self.prefill([(prepared, ctx, 0, n)])
            return Prefilled(ctx, logits)
        try:
            (logits,) = self.prefill([(prepared, staged, 0, n)])
            ctx.k.copy_(staged.k)
            ctx.v.copy_(staged.v)
            ctx.length = n
        finally:
            staged.release()
        return Prefilled(ctx, logits)

    @torch.inference_mode()
    def prefill(self, chunks: list[tuple[Prepared, ContextKV, int, int]]) -> list[torch.Tensor | None]:
        """Chunks (prepared, ctx, start, n): rows [start, start + n) of each context, in one packed pass, written
        into ctx. Returns the outputs at each chunk's last position. A retried pass rewrites the same positions."""
        segments = []
        for prepared, ctx, start, n in chunks:
            ctx.length = start
            segments.append((self.family.context_embeds(prepared, start, start + n), ctx))
        return self.family.prefill(segments, self.prefill_graphs)

    def pass_holds(self, rows_per_job: list[int]) -> bool:
        """Whether one decode pass may hold these jobs' rows: a captured graph holds at most `graph_max_rows` rows of
        at most `max_requests` requests (without graphs, any)."""
        return not self.graphs or (sum(rows_per_job) <= self.graph_max_rows and len(rows_per_job) <= self.max_requests)

    @torch.inference_mode()
    def capture(self, pool: KVPool, prefill_tokens: int) -> float:
        """Capture every decode pass of `pool` (16 rows up to `graph_max_rows`, each sequence capacity it may need;
        one span and MAX_SPANS) and the prefill stages up to `prefill_tokens`, in one session (the plan's). Once,
        before any request, so no capture overlaps other CUDA work. Returns the seconds it took."""
        started, before = time.perf_counter(), _device_bytes(self.device)
        if self.graph_max_rows is None:
            self.graph_max_rows = self._rows_to_capture(pool)
        with _on(self.device):
            session = self.plan.capture(self.device)
            self._capture_decode(pool, session)
            self.prefill_graphs = self.family.capture_prefill(session, prefill_tokens, pool)
        self.graph_bytes = _device_bytes(self.device) - before
        self.warmup_s = time.perf_counter() - started
        return self.warmup_s

    def _rows_to_capture(self, pool: KVPool) -> int:
        """The largest decode pass to capture, as the pool and the memory left beside it allow (capture_size)."""
        config, columns = self.model.config, getattr(self.family, "max_children", 1)
        per_row = decode_bytes_per_row(config, self.model.dtype.itemsize, columns)
        return rows_to_capture(self.max_requests, self.family.levels, pool.tokens, per_row, _free_bytes(self.device))

    def describe(self) -> dict:
        """What the captures hold (/v1/model `execution`, gpu_check): passes captured, the bytes of their static
        buffers (inputs and outputs, any device: an estimate the CPU can make) and, on CUDA, the device memory the
        capture session took in all (graphs' pool included: measured)."""
        holders = [batch for batch, _ in self._captured.values()] + [self.prefill_graphs] * bool(self.prefill_graphs)
        buffers = [t for holder in holders for t in vars(holder).values() if torch.is_tensor(t)]
        buffers += [t for batch, _ in self._captured.values() for t in batch.outputs or ()]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in buffers}
        return {
            "graph_max_rows": self.graph_max_rows,
            "captured_decode_passes": len(self._captured),
            "captured_prefill_buckets": len(self.prefill_graphs.buckets) if self.prefill_graphs else 0,
            "static_buffer_bytes": sum(storages.values()),
            "graph_bytes": self.graph_bytes,
            "warmup_s": self.warmup_s,
            "uncaptured_passes": self.uncaptured_passes,
        }

    def capacities(self, bucket: int) -> list[int]:
        """The sequence capacities captured for a row bucket (the plan's)."""
        return self.plan.capacities(bucket, self.max_requests)

    def _capture_decode(self, pool: KVPool, session) -> None:
        """Every decode pass, largest first, each graph's outputs copied into one set of buffers sized by the
        largest, so the [rows, vocab] outputs are held once, not per graph (internals go back to the shared pool)."""
        bucket, buckets = self.graph_max_rows, []
        while self.family.levels and bucket >= bucket_of(1):
            buckets.append(bucket)
            bucket //= 2
        outputs, columns = None, self.family.max_children if buckets else 0
        for bucket in buckets:
            for spans in (MAX_SPANS, 1):
                for capacity in reversed(self.capacities(bucket)):
                    batch = self._batch(bucket, pool, spans, columns, capacity, self.plan.selects_in_graph)
                    batch.fill([])  # all padding: rows without context, each seeing only its own token
                    if outputs is None:
                        outputs = [torch.empty_like(t) for t in self._captured_forward(batch)]
                    batch.outputs = _rows_of(outputs, bucket)
                    graph = session.graph(lambda batch=batch: _copy_into(batch.outputs, self._captured_forward(batch)))
                    self._captured[(id(pool), bucket, spans, capacity)] = (batch, graph)

    @torch.inference_mode()
    def decode(self, cohorts: list[BeamCohort], bucketed: bool | None = None) -> None:
        """One pass over the cohorts' rows (all in one pool): fill its inputs, run it as the plan says (a captured
        graph's replay, or eagerly), then advance every cohort by its selection (genrec.engine.selection).
        `bucketed` (default: with graphs) pads the rows to a power of two."""
        # Same-level cohorts of one catalog version adjacent: one selection each (selection.choices).
        selections = choices(sorted(cohorts, key=lambda c: (c.level, id(c.trie))))
        batch, graph = self._pass_for(cohorts, selections, self.graphs if bucketed is None else bucketed)
        rows = batch.fill(selections)
        gains, order = self._run(batch, graph)
        advance_all(selections, gains[:rows], None if order is None else order[:rows])

    def _pass_for(self, cohorts: list[BeamCohort], selections, bucketed: bool) -> tuple[DecodeBatch, object]:
        """The pass that holds these rows, and its captured graph (None: it runs eagerly). A bucketed pass of the
        graphed plan that no capture holds (wider than the largest, another pool) runs eagerly and is counted."""
        pool = cohorts[0].slot_pool
        rows, columns = sum(s.rows for s in selections), max(s.columns for s in selections)
        spans = max(len(ctx.spans()) for c in cohorts for ctx in c.contexts)
        if not bucketed:  # sized to the rows (the CPU's pass): no bucket, capacity or split to work out
            return self._batch(rows, pool, spans, columns), None
        capacity = self.plan.capacity([n for c in cohorts for n in c.rows_per_req])
        key = (id(pool), bucket_of(rows), 1 if spans == 1 and not self._splits(cohorts) else MAX_SPANS, capacity)
        if not self.graphs:
            return self._bucket((*key, columns), pool), None
        captured = self._captured.get(key)
        if captured is not None and captured[0].columns.shape[1] >= columns:
            return captured
        self.uncaptured_passes += 1
        return self._batch(rows, pool, spans, columns), None

    def _run(self, batch: DecodeBatch, graph) -> tuple:
        """The filled pass, its new K/V written: (gains, order), `order` the ranking where the pass selected itself
        (then the gains are its candidates' scores), else None."""
        if graph is None:
            return self._forward_writing(batch), None
        graph.replay()  # on the device it was captured on (a graph's replay guards it)
        gains, *order = batch.outputs
        return gains, order[0] if order else None

    def _splits(self, cohorts: list[BeamCohort]) -> bool:
        """Whether one-span contexts run split in the multi-span bucket (split-KV: the plan's policy)."""
        rows = [n for c in cohorts for n in c.rows_per_req]
        longest = max(ctx.length for c in cohorts for ctx in c.contexts)
        return self.plan.splits(rows, longest, self.model.config.num_attention_heads)

    def _batch(self, rows, pool, spans, columns, capacity=None, selects=False) -> DecodeBatch:
        return DecodeBatch(rows, self.past, pool, self.plan.ops, spans, columns, selects, capacity, SPLIT_MIN_CHUNK)

    def decode_forward(self, batch: DecodeBatch):
        """The pass over a filled batch: (gains [B, columns], new_k, new_v [layers, B, 1, kv_heads, hd])."""
        return self.family.decode_forward(batch)

    def _forward_writing(self, batch: DecodeBatch) -> torch.Tensor:
        """The pass's gains, its new K/V written into the pool inside the pass (in a captured graph too)."""
        gains, new_k, new_v = self.decode_forward(batch)
        batch.write_kv(new_k, new_v)
        return gains

    def _captured_forward(self, batch: DecodeBatch):
        """A captured pass: (gains,), or where it selects itself (candidates, order); its K/V written inside."""
        gains = self._forward_writing(batch)
        if batch.selection is None:
            return (gains,)
        return batch.selection.ranked(batch.pieces, gains)

    def _bucket(self, key: tuple, pool: KVPool) -> DecodeBatch:
        """A bucketed pass's inputs without a graph (the CPU runs the padded pass eagerly): kept per key."""
        if key not in self._buckets:
            _, bucket, spans, capacity, columns = key
            self._buckets[key] = self._batch(bucket, pool, spans, columns, capacity)
        return self._buckets[key]

    @torch.inference_mode()
    def rows_pass(self, jobs: list, budget: int) -> None:
        self.family.rows_pass(jobs, budget)


def _rows_of(outputs: list[torch.Tensor], rows: int) -> tuple[torch.Tensor, ...]:
    """The first `rows` rows of a decode pass's outputs (gains [B, columns]; where the pass selects itself, order
    [B, columns])."""
    return tuple(o[:rows] for o in outputs)


def _copy_into(targets, values) -> None:
    for target, value in zip(targets, values, strict=True):
        target.copy_(value)


def _on(device: torch.device):
    """The engine's device made current, so that streams, graphs and their pool are made on it (an engine on
    cuda:1 in a process whose current device is cuda:0 would otherwise capture nothing)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _free_bytes(device: torch.device) -> int:
    """The memory free on `device` now: the GPU's, or the host's available RAM (a CPU capture's stand-in)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _device_bytes(device: torch.device) -> int:
    """The device memory torch holds on `device` (its caching allocator's reservations; 0 on the CPU)."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
