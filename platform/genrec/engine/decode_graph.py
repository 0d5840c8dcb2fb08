"""The decode pass with static shapes: the same function runs eagerly on the CPU and as a CUDA graph.

Rows are padded up to a bucket (a power of two); the request mix, widths and context lengths are data in
fixed-size buffers, never shapes: token, position, ancestors (global slots of the KV pool, padded to the
longest suffix), suffix mask, and the varlen index tensors of the context call (one sequence per request,
one for the padding rows, empty ones up to the bucket). Padding rows see only their own token and no
context, and every op works row by row, so they never change a real row.

On CUDA with `CUDA_FAST` (GENREC_CUDA_FAST=1) each bucket is captured once and replayed; until a GPU
run has verified replay against eager, the switch stays off and the scheduler decodes eagerly.
"""

from __future__ import annotations

import numpy as np
import torch

from genrec.attention import StaticRows, shared_context_attention
from genrec.engine.beam import BeamCohort
from genrec.model.kv_pool import KVPool
from genrec.model.qwen3 import Qwen3
from genrec.staging import to_device


def bucket_of(rows: int, smallest: int = 16) -> int:
    return max(smallest, 1 << (rows - 1).bit_length())


class DecodeBuffers:
    """Static inputs and outputs of one bucket's decode pass."""

    def __init__(self, bucket: int, past: int, device):
        self.bucket, self.past = bucket, past
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.tokens = torch.zeros(bucket, **i64)
        self.positions = torch.zeros(bucket, **i64)
        self.ancestors = torch.zeros(bucket, past, **i64)
        self.mask = torch.ones(bucket, 1, past + 1, dtype=torch.bool, device=device)
        self.cu_q = torch.zeros(bucket + 2, **i32)  # up to one sequence per row, plus the padding's
        self.cu_k = torch.zeros(bucket + 2, **i32)
        self.used_k = torch.zeros(bucket + 1, **i32)
        self.row_empty = torch.zeros(bucket, dtype=torch.bool, device=device)
        self.outputs = None  # (logprobs, new_k, new_v) of a captured graph

    def fill(self, cohorts: list[BeamCohort]) -> int:
        """Copy the pass's inputs in (device to device, and host index tables staged); returns the real rows."""
        B, P = self.bucket, self.past
        device = self.tokens.device
        rows, pasts, offsets, lengths, counts = 0, [], [], [], []
        for c in cohorts:
            n, p = c.rows, c.level - 1  # this pass feeds level c.level's tokens; p earlier tokens per row
            step_inputs = c.decode_inputs(gather=False)
            self.tokens[rows : rows + n] = step_inputs[0][:, 0]
            self.positions[rows : rows + n] = step_inputs[1][:, 0]
            if p:
                self.ancestors[rows : rows + n, :p] = c.ancestors + c.slot_offset
            pasts += [p] * n
            for ctx, width in zip(c.contexts, c.rows_per_req, strict=True):
                offsets.append(ctx.offset)
                lengths.append(ctx.length)
                counts.append(width)
            rows += n
        pad = B - rows
        pasts = np.asarray(pasts + [0] * pad)
        mask = np.arange(P + 1)[None, :] < pasts[:, None]
        mask[:, P] = True  # every row sees its own new token
        cu = np.cumsum([0, *counts, pad])
        cu_q = np.concatenate([cu, np.full(B + 2 - len(cu), B)])
        starts = np.asarray(offsets + [0] * (B + 2 - len(offsets)))
        used = np.asarray(lengths + [0] * (B + 1 - len(lengths)))
        empty = np.repeat(np.asarray(lengths + [0]) == 0, [*counts, pad])
        for buffer, host, dtype in (
            (self.mask, mask[:, None], torch.bool),
            (self.cu_q, cu_q, torch.int32),
            (self.cu_k, starts, torch.int32),
            (self.used_k, used, torch.int32),
            (self.row_empty, empty, torch.bool),
        ):
            buffer.copy_(to_device(host, device, dtype), non_blocking=True)
        if pad:
            self.tokens[rows:] = 0
            self.positions[rows:] = 0
        return rows


def decode_forward(model: Qwen3, pool: KVPool, buf: DecodeBuffers):
    """One decode pass over the bucket: (logprobs [B, vocab], new_k, new_v [layers, B, 1, kv_heads, hd])."""
    embeds = model.embed(buf.tokens[:, None])
    cos, sin = model.rotary.cos_sin(buf.positions[:, None], embeds.dtype)
    past_k = pool.k[:, buf.ancestors] if buf.past else None  # [layers, B, P, KV, D]: one gather
    past_v = pool.v[:, buf.ancestors] if buf.past else None
    x, new_k, new_v = embeds, [], []
    for i, layer in enumerate(model.model.layers):
        q, k, v = layer.self_attn.qkv_heads(layer.input_layernorm(x), cos, sin)
        new_k.append(k)
        new_v.append(v)
        if buf.past:
            k, v = torch.cat((past_k[i], k), dim=1), torch.cat((past_v[i], v), dim=1)
        rows = StaticRows(pool.k[i], pool.v[i], buf.cu_q, buf.cu_k, buf.used_k, buf.row_empty, pool.tokens)
        x = layer.finish(x, shared_context_attention(q, rows, k, v, buf.mask, layer.self_attn.scale))
    logprobs = torch.log_softmax(model.logits(x[:, -1]), dim=-1)
    return logprobs, torch.stack(new_k), torch.stack(new_v)


class DecodeRunner:
    """Runs decode passes of cohorts whose BeamKV slots live in `pool`: eagerly, or (`graphs`, CUDA) by
    replaying one captured graph per bucket."""

    def __init__(self, model: Qwen3, pool: KVPool, levels: int, graphs: bool = False):
        self.model, self.pool, self.past = model, pool, max(levels - 2, 0)
        self.graphs = graphs and pool.k.device.type == "cuda"
        self.buffers: dict[int, DecodeBuffers] = {}
        self._captured: dict[int, torch.cuda.CUDAGraph] = {}
        self._mempool = None

    def accepts(self, cohorts: list[BeamCohort]) -> bool:
        return all(c.slot_pool is self.pool and all(x.pool is self.pool for x in c.contexts) for c in cohorts)

    def run(self, cohorts: list[BeamCohort]):
        """(logprobs, new_k, new_v) of the cohorts' real rows, in cohort order."""
        rows = sum(c.rows for c in cohorts)
        bucket = bucket_of(rows)
        buf = self.buffers.get(bucket)
        if buf is None:
            buf = self.buffers[bucket] = DecodeBuffers(bucket, self.past, self.pool.k.device)
        buf.fill(cohorts)
        if not self.graphs:
            logprobs, new_k, new_v = decode_forward(self.model, self.pool, buf)
        else:
            logprobs, new_k, new_v = self._replay(bucket, buf)
        return logprobs[:rows], new_k[:, :rows], new_v[:, :rows]

    def _replay(self, bucket: int, buf: DecodeBuffers):
        graph = self._captured.get(bucket)
        if graph is None:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                decode_forward(self.model, self.pool, buf)  # warm-up outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            self._mempool = self._mempool or torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._mempool):
                buf.outputs = decode_forward(self.model, self.pool, buf)
            self._captured[bucket] = graph
        graph.replay()
        return buf.outputs
