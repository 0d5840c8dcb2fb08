"""The inputs of one decode pass over many beam cohorts (of any levels), as data in fixed-size buffers, never
as shapes: padded to a power-of-two bucket so one captured CUDA graph per bucket replays any request mix. Padding
rows see only their own token and no context, and every op works row by row, so they never change a real row.
The pass outputs each row's log-probabilities at its trie children's tokens only (`columns`, as wide as any node's
children may be), so a catalog version or a filter changes data, never a shape, and no [rows, vocab] is written.

The context call's launch is frozen at capture too: FlashAttention-2 launches ceil(max_q / 128) x sequences x heads
thread blocks. So each request's rows are cut into sequences of at most the kernel's query block (max_q is one
block), and a pass holds at most `sequences` of them per span (its capacity, a power of two the runner picks by the
pass): the blocks launched stay within twice the blocks with work, whatever the padding.
"""

from __future__ import annotations

import numpy as np
import torch

from genrec.attention import StaticContext
from genrec.engine.selection import Choices, InGraphSelection
from genrec.model.ops import ModelOps
from genrec.staging import to_device


def bucket_of(rows: int, smallest: int = 16) -> int:
    return max(smallest, 1 << (rows - 1).bit_length())


def sequences_of(rows_per_context: list[int], query_block: int | None) -> int:
    """The sequences a span of a pass holds: each context's rows cut into runs of at most `query_block` (None: one
    run each)."""
    if query_block is None:
        return len(rows_per_context)
    return sum(-(-rows // query_block) for rows in rows_per_context)


def capacity_of(sequences: int) -> int:
    """The capacity (sequences per span, a power of two) of the captured pass that holds `sequences`."""
    return 1 << max(sequences - 1, 0).bit_length()


def split_spans(spans: list[tuple[int, int]], blocks: int, min_chunk: int) -> list:
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


class DecodeBatch:
    """The inputs (and a captured graph's outputs) of a decode pass of up to `bucket` rows over one pool."""

    def __init__(
        self,
        bucket: int,
        past: int,
        pool,
        ops: ModelOps,
        spans: int = 1,
        columns: int = 1,
        selects: bool = False,
        sequences: int | None = None,
        split_min_chunk: int = 0,
    ):
        """`ops`: the plan's; `spans`: the most spans a context of the pass may have (prefix pieces plus its own part,
        or the chunks split-KV cuts it into, each at least `split_min_chunk` tokens); `columns`: the most children a
        row's node may have; `selects`: the pass ranks its candidates itself (`ranked`); `sequences`: the most
        sequences a span holds (`sequences_of`; default: one a row, any mix)."""
        self.bucket, self.past, self.pool, self.spans = bucket, past, pool, spans
        self.pieces, self.query_block = ops.pieces, ops.attention.query_block
        self.sequences = bucket if sequences is None else sequences
        self.split_min_chunk = split_min_chunk
        device = pool.k.device
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.tokens = torch.zeros(bucket, **i64)
        self.columns = torch.zeros(bucket, columns, **i64)  # the tokens whose log-probabilities the pass returns
        self.positions = torch.zeros(bucket, **i64)
        self.ancestors = torch.zeros(bucket, past, **i64)
        self.own_slots = torch.zeros(bucket, **i64)  # where each row's new token's K/V goes (write_kv)
        self.mask = torch.ones(bucket, 1, past + 1, dtype=torch.bool, device=device)
        sequences = spans * (self.sequences + 1)  # per span: its capacity, plus the padding's
        self.context = StaticContext(
            pool,
            bucket,
            spans,
            cu_q=torch.zeros(sequences + 1, **i32),
            cu_k=torch.zeros(sequences + 1, **i32),
            used_k=torch.zeros(sequences, **i32),
            row_empty=torch.ones(spans * bucket, dtype=torch.bool, device=device),
            kernels=ops.attention,
            merge=self.pieces.merge_spans,
        )
        self.selection = InGraphSelection(bucket, columns, device) if selects else None  # the pass ranks too
        self.outputs = None  # (gains[, order]) of a captured graph

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
            spans = [split_spans(s, self.spans, self.split_min_chunk) for s in spans]
        pad = self.bucket - rows
        mask = np.arange(self.past + 1)[None, :] < np.asarray(pasts + [0] * pad)[:, None]
        mask[:, self.past] = True  # every row sees its own new token
        copies = [(self.mask, mask[:, None], torch.bool), *self._span_tables(spans, counts, pad)]
        padding = np.full(pad, self.pool.scratch, dtype=np.int64)  # padding rows' K/V: the pool's scratch slot
        copies.append((self.own_slots, np.concatenate([*own, padding]), torch.int64))
        if self.selection is not None:
            copies.append(self.selection.fill(selections, counts, pad))
        device = self.tokens.device
        for buffer, host, dtype in copies:
            buffer.copy_(to_device(host, device, dtype), non_blocking=True)
        if pad:
            self.tokens[rows:] = 0
            self.positions[rows:] = 0
        return rows

    def write_kv(self, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        """The pass's new K/V [layers, B, 1, kv_heads, hd] into each row's own slot, inside the pass (a captured
        graph writes them itself): one scatter each for every cohort and layer; padding rows write the scratch slot."""
        self.pool.k.index_copy_(1, self.own_slots, new_k[:, :, 0])
        self.pool.v.index_copy_(1, self.own_slots, new_v[:, :, 0])

    def _fill_columns(self, selections: list[Choices]) -> None:
        """Each row's children's tokens, left-aligned (the columns past a row's own count are never read)."""
        width, row = self.columns.shape[1], 0
        for selection in selections:
            if selection.columns > width:
                raise ValueError(f"a node has {selection.columns} children; this batch holds {width}")
            self.columns[row : row + selection.rows, : selection.columns] = selection.token
            row += selection.rows

    def _span_tables(self, spans: list[list[tuple[int, int]]], counts: list[int], pad: int) -> list:
        """The varlen index tables: block j (rows repeated) holds every request's span j, its rows cut into runs of at
        most a query block (`sequences_of`), then the padding rows (no keys); empty sequences fill each block up to
        its capacity."""
        B, S, Q = self.bucket, self.spans, self.query_block
        runs = [[min(Q, n - a) for a in range(0, n, Q)] if Q is not None and n > Q else [n] for n in counts]
        if len(sum(runs, [])) > self.sequences:
            raise ValueError(f"the pass's {len(sum(runs, []))} sequences exceed the {self.sequences} it holds")
        owner = np.repeat(np.arange(len(counts)), [len(r) for r in runs])  # each run's request
        fill = self.sequences - len(owner)
        sizes = np.asarray([*sum(runs, []), pad] + [0] * fill, dtype=np.int64)  # sequences + 1 per block
        starts_q = np.cumsum(sizes) - sizes
        cu_q, starts, used, empty = [], [], [], []
        for j in range(S):
            span_j = np.asarray([s[j] if j < len(s) else (0, 0) for s in spans] or np.zeros((0, 2)), dtype=np.int64)
            offsets = np.concatenate([span_j[owner, 0], np.zeros(fill + 1, dtype=np.int64)])
            lengths = np.concatenate([span_j[owner, 1], np.zeros(fill + 1, dtype=np.int64)])
            cu_q.append(j * B + starts_q)
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
