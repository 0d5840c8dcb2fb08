"""The model runner: runs the passes the scheduler decides (prefill chunks, decode, rows), through the engine's
family. On CUDA with `fast`, decode replays a graph per row bucket, all captured once at engine start (`capture`),
never on a live request. The family's `fast` is passed down, never read from a global.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from genrec.engine.beam import BeamCohort, advance_all, choices
from genrec.engine.decode_batch import DecodeBatch, bucket_of, splitting_pays
from genrec.engine.family import Family
from genrec.engine.job import Prepared
from genrec.model.kv_pool import MAX_SPANS, ContextKV, KVPool


@dataclass
class Prefilled:
    """A context prefilled on its own: its ContextKV and the float32 outputs at its last position."""

    ctx: ContextKV
    last_logits: torch.Tensor | None


class ModelRunner:
    def __init__(self, family: Family, graph_max_rows: int = 2048, selects_in_graph: bool = False):
        """`graph_max_rows`: the largest decode pass captured at start; the scheduler caps passes there."""
        # torch's compiler, which the attention's custom ops import on their first call: here, as the engine loads,
        # not in its first request (a process that only checks a model directory never imports it).
        import torch._dynamo  # noqa: F401

        self.family, self.model = family, family.model
        self.device = self.model.device
        self.fast = family.fast
        # Passes replayed as CUDA graphs: with the FlashAttention-2 kernel only (bf16 / fp16), whose index tables stay
        # on the device; a float32 engine's attention reads them on the host, which no graph can hold.
        half = self.model.dtype in (torch.float16, torch.bfloat16)
        self.compiles = self.fast and self.device.type == "cuda"  # its pieces compiled (model/fused.py)
        self.graphs = self.compiles and half
        # The SMs a pass's context call should fill (split-KV, decode_batch.splitting_pays); 0: never split.
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.graphs else 0
        self.graph_max_rows = bucket_of(graph_max_rows)
        self.past = max(family.levels - 2, 0)  # the longest beam suffix a decode pass reads
        self._buckets: dict[tuple, DecodeBatch] = {}  # (pool, bucket, spans, columns) -> a bucketed pass (no graph)
        self._captured: dict[tuple, tuple[DecodeBatch, object]] = {}  # (pool, bucket, spans) -> (inputs, graph)
        self.capture_pass = _CudaGraph  # how a pass is captured (the tests' recorder on the CPU)
        # Captured passes select their beams themselves (DecodeBatch.ranked: a sort in the graph) rather than by an
        # eager top-k after the replay (the `cuda_graph_selection` option). Off until a GPU measures which is faster
        # (genrec_bench.gpu_check). Read when the passes are captured (the engine's start): later, it changes nothing.
        self.selects_in_graph = selects_in_graph
        self.warmup_s: float | None = None  # how long `capture` and the engine's warm-up requests took
        self.uncaptured_passes = 0  # bucketed passes that found no captured graph (ran eagerly; none expected)
        self.prefill_graphs = None  # the prefill's stages per token bucket, once captured

    def new_pool(self, tokens: int) -> KVPool:
        return KVPool(self.model.config, tokens, self.device, self.model.dtype)

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
        return self.family.prefill(segments, self.prefill_graphs)

    @property
    def max_pass_rows(self) -> int | None:
        """The most rows one decode pass should hold: the largest captured bucket (None: no bound)."""
        return self.graph_max_rows if self.graphs else None

    @torch.inference_mode()
    def capture(self, pool: KVPool, prefill_tokens: int) -> float:
        """Capture every decode bucket of `pool` (16 rows up to `graph_max_rows`; one span and MAX_SPANS) and the
        prefill stages up to `prefill_tokens`. Once, before any request, so no capture overlaps other CUDA work (a
        pass not captured here runs eagerly). Returns the seconds it took."""
        started = time.perf_counter()
        with _on(self.device):
            mempool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
            self._capture_decode(pool, mempool)
            self.prefill_graphs = self.family.capture_prefill(self.capture_pass, mempool, prefill_tokens)
        self.warmup_s = time.perf_counter() - started
        return self.warmup_s

    def _capture_decode(self, pool: KVPool, mempool) -> None:
        """Every decode bucket, largest first, each graph's outputs copied into one set of buffers sized by the
        largest, so the [rows, vocab] outputs are held once, not per graph (internals go back to the shared pool)."""
        bucket, buckets = self.graph_max_rows, []
        while self.family.levels and bucket >= bucket_of(1):
            buckets.append(bucket)
            bucket //= 2
        outputs, columns = None, self.family.max_children if buckets else 0
        for bucket in buckets:
            for spans in (MAX_SPANS, 1):
                batch = DecodeBatch(bucket, self.past, pool, spans, self.fast, columns, self.selects_in_graph)
                batch.fill([])  # all padding: rows without context, each seeing only its own token
                if outputs is None:
                    outputs = [torch.empty_like(t) for t in self._captured_forward(batch)]
                batch.outputs = _rows_of(outputs, bucket)
                graph = self.capture_pass(
                    lambda batch=batch: _copy_into(batch.outputs, self._captured_forward(batch)), mempool
                )
                self._captured[(id(pool), bucket, spans)] = (batch, graph)

    @torch.inference_mode()
    def decode(self, cohorts: list[BeamCohort], bucketed: bool | None = None) -> None:
        """One pass over the cohorts' rows (all in one pool), then their selections. `bucketed` (default: with CUDA
        graphs) pads the rows to a power of two."""
        # Same-level cohorts of one catalog version adjacent: one selection each (beam.choices).
        selections = choices(sorted(cohorts, key=lambda c: (c.level, id(c.trie))))
        pool = cohorts[0].slot_pool
        rows, columns = sum(s.rows for s in selections), max(s.columns for s in selections)
        spans = max(len(ctx.spans()) for c in cohorts for ctx in c.contexts)
        key = (id(pool), bucket_of(rows), 1 if spans == 1 and not self._splits(cohorts) else MAX_SPANS)
        bucketed = self.graphs if bucketed is None else bucketed
        captured = self._captured.get(key) if bucketed and self.graphs else None
        if captured is not None and captured[0].columns.shape[1] >= columns:
            batch, graph = captured
            batch.fill(selections)
            graph.replay()  # on the device it was captured on (a graph's replay guards it)
            gains, new_k, new_v, *ranked = batch.outputs
        else:
            if bucketed and self.graphs:
                self.uncaptured_passes += 1  # larger than the largest bucket, or another pool: eager, never captured
            batch = (
                self._bucket((*key, columns), pool)
                if bucketed and not self.graphs
                else DecodeBatch(rows, self.past, pool, spans, self.fast, columns)
            )
            batch.fill(selections)
            (gains, new_k, new_v), ranked = self.decode_forward(batch), []
        order = ranked[0][:rows] if ranked else None  # the pass selected itself: gains are its candidates
        batch.record_kv(new_k, new_v, rows)
        advance_all(selections, gains[:rows], order)

    def _splits(self, cohorts: list[BeamCohort]) -> bool:
        """Whether one-span contexts run split in the multi-span bucket (split-KV: decode_batch.splitting_pays)."""
        if not self.sms:
            return False
        rows = [n for c in cohorts for n in c.rows_per_req]
        longest = max(ctx.length for c in cohorts for ctx in c.contexts)
        return splitting_pays(rows, longest, self.model.config.num_attention_heads, self.sms)

    def decode_forward(self, batch: DecodeBatch):
        """The pass over a filled batch: (gains [B, columns], new_k, new_v [layers, B, 1, kv_heads, hd])."""
        return self.family.decode_forward(batch)

    def _captured_forward(self, batch: DecodeBatch):
        """A captured pass: (gains, new_k, new_v), or where it selects itself (candidates, new_k, new_v, order)."""
        gains, new_k, new_v = self.decode_forward(batch)
        if not batch.selects:
            return gains, new_k, new_v
        candidates, order = batch.ranked(gains)
        return candidates, new_k, new_v, order

    def _bucket(self, key: tuple, pool: KVPool) -> DecodeBatch:
        """A bucketed pass's inputs without a graph (the CPU runs the padded pass eagerly): kept per key."""
        if key not in self._buckets:
            self._buckets[key] = DecodeBatch(key[1], self.past, pool, key[2], self.fast, key[3])
        return self._buckets[key]

    @torch.inference_mode()
    def rows_pass(self, jobs: list, budget: int) -> None:
        self.family.rows_pass(jobs, budget)


def _rows_of(outputs: list[torch.Tensor], rows: int) -> tuple[torch.Tensor, ...]:
    """The first `rows` rows of a decode pass's outputs (gains [B, columns]; new_k, new_v [layers, B, ...]; where
    the pass selects itself, order [B, columns])."""
    gains, new_k, new_v, *order = outputs
    return gains[:rows], new_k[:, :rows], new_v[:, :rows], *(o[:rows] for o in order)


def _copy_into(targets, values) -> None:
    for target, value in zip(targets, values, strict=True):
        target.copy_(value)


def _on(device: torch.device):
    """The engine's device made current, so that streams, graphs and their pool are made on it (an engine on
    cuda:1 in a process whose current device is cuda:0 would otherwise capture nothing)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class _CudaGraph:
    """A pass captured as a CUDA graph (with the engine's device current): `replay()` reruns it on its buffers."""

    def __init__(self, forward, mempool):
        """`mempool`: shared by the engine's captured passes (captured largest first, replayed one at a time)."""
        stream = torch.cuda.Stream()  # on the current device: the engine's
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()  # warm-up outside the capture (lazy initialisations, autotuning)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA call cannot invalidate this capture (a second guard: captures run
        # at engine start, before any request, and nothing outside the engine's thread issues device work). The
        # capture stream is our own: torch's default one is made once per process, on whichever device was first.
        with torch.cuda.graph(self.graph, pool=mempool, stream=stream, capture_error_mode="thread_local"):
            self.outputs = forward()

    def replay(self) -> None:
        self.graph.replay()
