"""The inputs of one decode pass over many beam cohorts (of any levels), as data in fixed-size buffers, never
as shapes: padded to a power-of-two bucket so one captured CUDA graph per bucket replays any request mix. Padding
rows see only their own token and no context, and every op works row by row, so they never change a real row.
The pass outputs each row's log-probabilities at its trie children's tokens only (`columns`, as wide as any node's
children may be), so a catalog version or a filter changes data, never a shape, and no [rows, vocab] is written.
"""

from __future__ import annotations

import numpy as np
import torch

from genrec.attention import StaticContext
from genrec.engine.beam import Choices
from genrec.model import fused
from genrec.staging import to_device

# Split-KV (a multi-span pass's spare blocks read a long context in parallel): no chunk shorter than this, and a
# pass of one-span contexts takes the multi-span bucket only when a context holds two such chunks. Not yet tuned on a
# GPU: FlashAttention-2 walks a sequence's keys in blocks of 64-128, so 512 keys are a few iterations per thread block.
SPLIT_MIN_CHUNK = 512
QUERY_BLOCK = 128  # query rows per FlashAttention-2 thread block (head dim 128, sm80 and later)


def bucket_of(rows: int, smallest: int = 16) -> int:
    return max(smallest, 1 << (rows - 1).bit_length())


def split_spans(spans: list[tuple[int, int]], blocks: int, min_chunk: int = SPLIT_MIN_CHUNK) -> list:
    """A context's (pool offset, tokens) spans cut into at most `blocks` chunks, the longest halved first while its
    halves hold `min_chunk` tokens. The context call merges its spans exactly (log-sum-exp), so the cut changes no
    result, only how many thread blocks read the context at once."""
    spans = list(spans)
    while len(spans) < blocks:
        longest = max(range(len(spans)), key=lambda i: spans[i][1])
        start, tokens = spans[longest]
        if tokens < 2 * min_chunk:
            break
        half = tokens // 2
        spans[longest : longest + 1] = [(start, half), (start + half, tokens - half)]
    return spans


def splitting_pays(rows_per_context: list[int], longest_context: int, heads: int, sms: int) -> bool:
    """Whether a pass of one-span contexts should run split in the multi-span bucket: its context call would run
    fewer thread blocks (query blocks times heads, one set per context) than the GPU has SMs, and a context is long
    enough to cut. A wide batch fills the GPU as it is, and a short context is read at once."""
    blocks = sum(-(-rows // QUERY_BLOCK) for rows in rows_per_context) * heads
    return blocks < sms and longest_context >= 2 * SPLIT_MIN_CHUNK


class DecodeBatch:
    """The inputs (and a captured graph's outputs) of a decode pass of up to `bucket` rows over one pool."""

    def __init__(
        self, bucket: int, past: int, pool, spans: int = 1, fast: bool = False, columns: int = 1, selects=False
    ):
        """`spans`: the most spans a context of the pass may have (prefix pieces plus its own part); `columns`: the
        most children a row's node may have; `selects`: the pass ranks its candidates itself (`ranked`)."""
        self.bucket, self.past, self.pool, self.spans = bucket, past, pool, spans
        self.pieces, self.selects = fused.pieces(fast, pool.k.device), selects  # compiled on CUDA with `fast`
        device = pool.k.device
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.tokens = torch.zeros(bucket, **i64)
        self.columns = torch.zeros(bucket, columns, **i64)  # the tokens whose log-probabilities the pass returns
        self.positions = torch.zeros(bucket, **i64)
        self.ancestors = torch.zeros(bucket, past, **i64)
        self.own_slots = torch.zeros(bucket, **i64)  # where each row's new token's K/V goes (record_kv)
        self.mask = torch.ones(bucket, 1, past + 1, dtype=torch.bool, device=device)
        sequences = spans * (bucket + 1)  # per span: up to one sequence per row, plus the padding's
        self.context = StaticContext(
            pool,
            bucket,
            spans,
            cu_q=torch.zeros(sequences + 1, **i32),
            cu_k=torch.zeros(sequences + 1, **i32),
            used_k=torch.zeros(sequences, **i32),
            row_empty=torch.ones(spans * bucket, dtype=torch.bool, device=device),
            fast=fast,
            merge=self.pieces.merge_spans,
        )
        if selects:  # what a selection reads besides the pass's gains (beam.Choices), padded: never allowed
            self.scores = torch.zeros(bucket, dtype=torch.float32, device=device)
            self.allowed = torch.zeros(bucket, columns, dtype=torch.bool, device=device)
            self.free = torch.zeros(bucket, columns, dtype=torch.bool, device=device)
            self.segment = torch.zeros(bucket, **i64)  # each row's request in the pass; padding rows after all
        self.outputs = None  # (gains, new_k, new_v[, order]) of a captured graph

    def fill(self, selections: list[Choices]) -> int:
        """Copy the pass's inputs in (device to device, and host index tables staged); returns the real rows."""
        self._fill_columns(selections)
        rows, pasts, spans, counts, own = 0, [], [], [], []
        for c in (c for selection in selections for c in selection.cohorts):
            n, p = c.rows, c.level - 1  # this pass feeds level c.level's tokens; p earlier tokens per row
            self.tokens[rows : rows + n], self.positions[rows : rows + n] = c.step_inputs()
            if p:
                self.ancestors[rows : rows + n, :p] = c.ancestors + c.slot_offset
            pasts += [p] * n
            own.append(c.slot_offset + c.base[p] + np.arange(n))  # this pass's slots of the cohort's BeamKV
            for ctx, width in zip(c.contexts, c.rows_per_req, strict=True):
                spans.append(ctx.spans())
                counts.append(width)
            rows += n
        if spans and max(map(len, spans)) > self.spans:
            raise ValueError(f"a context has more than the {self.spans} spans this batch holds")
        if self.spans > 1:
            spans = [split_spans(s, self.spans) for s in spans]
        pad = self.bucket - rows
        mask = np.arange(self.past + 1)[None, :] < np.asarray(pasts + [0] * pad)[:, None]
        mask[:, self.past] = True  # every row sees its own new token
        copies = [(self.mask, mask[:, None], torch.bool), *self._span_tables(spans, counts, pad)]
        copies.append((self.own_slots, np.concatenate([*own, np.zeros(pad, dtype=np.int64)]), torch.int64))
        if self.selects:
            copies.append(self._fill_selection(selections, counts, pad))
        device = self.tokens.device
        for buffer, host, dtype in copies:
            buffer.copy_(to_device(host, device, dtype), non_blocking=True)
        if pad:
            self.tokens[rows:] = 0
            self.positions[rows:] = 0
        return rows

    def record_kv(self, new_k: torch.Tensor, new_v: torch.Tensor, rows: int) -> None:
        """The pass's new K/V [layers, >= rows, 1, kv_heads, hd] into its real rows' own slots: one scatter each for
        every cohort of the pass (the padding rows' are dropped)."""
        at = self.own_slots[:rows]
        self.pool.k.index_copy_(1, at, new_k[:, :rows, 0])
        self.pool.v.index_copy_(1, at, new_v[:, :rows, 0])

    def _fill_columns(self, selections: list[Choices]) -> None:
        """Each row's children's tokens, left-aligned (the columns past a row's own count are never read)."""
        width, row = self.columns.shape[1], 0
        for selection in selections:
            if selection.columns > width:
                raise ValueError(f"a node has {selection.columns} children; this batch holds {width}")
            self.columns[row : row + selection.rows, : selection.columns] = selection.token
            row += selection.rows

    def _fill_selection(self, selections: list[Choices], counts: list[int], pad: int) -> tuple:
        """The selections' scores, allowed and free children into their rows (device to device); the padding
        allows nothing. Returns the segment table's host copy."""
        row = 0
        for selection in selections:
            rows, C = slice(row, row + selection.rows), selection.columns
            self.scores[rows] = selection.scores
            self.allowed[rows, :C] = selection.allowed
            self.free[rows, :C] = selection.free if selection.free is not None else False
            if C < self.allowed.shape[1]:
                self.allowed[rows, C:] = False
            row = rows.stop
        self.allowed[row:] = False
        return self.segment, np.repeat(np.arange(len(counts) + 1), [*counts, pad]), torch.int64

    def ranked(self, gains: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass's own selection (`selects`): its candidates [B, W] and, per request, their flat indices best
        first [B, W] (one stable sort of `fused.selection_keys`: every request's top-k in fixed shapes)."""
        cand, keys = self.pieces.selection_keys(self.scores, gains, self.allowed, self.free, self.segment)
        return cand, keys.flatten().sort(stable=True).indices.view_as(keys)

    def _span_tables(self, spans: list[list[tuple[int, int]]], counts: list[int], pad: int) -> list:
        """The varlen index tables: block j (rows repeated) holds every request's span j, then the padding rows
        (no keys); empty sequences fill each block up to its fixed size."""
        B, S = self.bucket, self.spans
        sizes = [*counts, pad] + [0] * (B + 1 - len(counts) - 1)  # B + 1 sequences per block
        ends = np.cumsum(sizes)
        cu_q, starts, used, empty = [], [], [], []
        for j in range(S):
            span_j = [s[j] if j < len(s) else (0, 0) for s in spans] + [(0, 0)] * (B + 1 - len(spans))
            offsets, lengths = np.asarray(span_j, dtype=np.int64).reshape(-1, 2).T
            cu_q.append(j * B + ends - np.asarray(sizes))
            starts.append(offsets)
            used.append(lengths)
            empty.append(np.repeat(lengths == 0, sizes))
        cu_q.append([S * B])
        starts.append([0])
        c = self.context
        return [
            (c.cu_q, np.concatenate(cu_q), torch.int32),
            (c.cu_k, np.concatenate(starts), torch.int32),
            (c.used_k, np.concatenate(used), torch.int32),
            (c.row_empty, np.concatenate(empty), torch.bool),
        ]
