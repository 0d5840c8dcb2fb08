"""The inputs of one decode pass over many beam cohorts, as data in fixed-size buffers, never as shapes.

Token, position, ancestors (global slots of the KV pool, padded to the longest suffix), suffix mask, and the
varlen index tensors of the context call (one sequence per request, one for the padding rows, empty ones up
to the size). Cohorts at different levels mix freely. Sized to the rows exactly (the CPU), or padded to a
bucket (a power of two) so that one captured CUDA graph per bucket replays any request mix: padding rows see
only their own token and no context, and every op works row by row, so they never change a real row.
"""

from __future__ import annotations

import numpy as np
import torch

from genrec.attention import SpanIndex, StaticContext
from genrec.engine.beam import BeamCohort
from genrec.staging import to_device


def bucket_of(rows: int, smallest: int = 16) -> int:
    return max(smallest, 1 << (rows - 1).bit_length())


class DecodeBatch:
    """The inputs (and a captured graph's outputs) of a decode pass of up to `bucket` rows over one pool."""

    def __init__(self, bucket: int, past: int, pool, spans: int = 1, fast: bool = False):
        """`spans`: the most spans a context of the pass may have (prefix pieces plus its own part)."""
        self.bucket, self.past, self.pool = bucket, past, pool
        device = pool.k.device
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.tokens = torch.zeros(bucket, **i64)
        self.positions = torch.zeros(bucket, **i64)
        self.ancestors = torch.zeros(bucket, past, **i64)
        self.mask = torch.ones(bucket, 1, past + 1, dtype=torch.bool, device=device)
        span = lambda: SpanIndex(  # noqa: E731
            cu_k=torch.zeros(bucket + 2, **i32),
            used_k=torch.zeros(bucket + 1, **i32),
            row_empty=torch.zeros(bucket, dtype=torch.bool, device=device),
        )
        cu_q = torch.zeros(bucket + 2, **i32)  # up to one sequence per row, plus the padding's
        self.context = StaticContext(pool, cu_q, tuple(span() for _ in range(spans)), fast)
        self.outputs = None  # (logprobs, new_k, new_v) of a captured graph

    def fill(self, cohorts: list[BeamCohort]) -> int:
        """Copy the pass's inputs in (device to device, and host index tables staged); returns the real rows."""
        B, P = self.bucket, self.past
        device = self.tokens.device
        rows, pasts, spans, counts = 0, [], [], []
        for c in cohorts:
            n, p = c.rows, c.level - 1  # this pass feeds level c.level's tokens; p earlier tokens per row
            self.tokens[rows : rows + n], self.positions[rows : rows + n] = c.step_inputs()
            if p:
                self.ancestors[rows : rows + n, :p] = c.ancestors + c.slot_offset
            pasts += [p] * n
            for ctx, width in zip(c.contexts, c.rows_per_req, strict=True):
                spans.append(ctx.spans())
                counts.append(width)
            rows += n
        pad = B - rows
        pasts = np.asarray(pasts + [0] * pad)
        mask = np.arange(P + 1)[None, :] < pasts[:, None]
        mask[:, P] = True  # every row sees its own new token
        cu = np.cumsum([0, *counts, pad])
        cu_q = np.concatenate([cu, np.full(B + 2 - len(cu), B)])
        copies = [(self.mask, mask[:, None], torch.bool), (self.context.cu_q, cu_q, torch.int32)]
        for j, index in enumerate(self.context.spans):  # span j of every context (none: an empty span)
            offsets = [s[j][0] if j < len(s) else 0 for s in spans]
            lengths = [s[j][1] if j < len(s) else 0 for s in spans]
            starts = np.asarray(offsets + [0] * (B + 2 - len(offsets)))
            used = np.asarray(lengths + [0] * (B + 1 - len(lengths)))
            empty = np.repeat(np.asarray(lengths + [0]) == 0, [*counts, pad])
            copies += [(index.cu_k, starts, torch.int32), (index.used_k, used, torch.int32)]
            copies.append((index.row_empty, empty, torch.bool))
        if max(map(len, spans)) > len(self.context.spans):
            raise ValueError(f"a context has more than the {len(self.context.spans)} spans this batch holds")
        for buffer, host, dtype in copies:
            buffer.copy_(to_device(host, device, dtype), non_blocking=True)
        if pad:
            self.tokens[rows:] = 0
            self.positions[rows:] = 0
        return rows
