"""Index tensors of a row layout (request r owns rows_per_req[r] consecutive rows of a pass), built on the host
once per layout and kept (bounded in bytes): what a beam cohort and a selection gather with, never a host sync."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import torch

from genrec.staging import to_device


def row_layout(rows_per_req: tuple[int, ...], device) -> dict[str, torch.Tensor]:
    """Index tensors of a row layout (request r owns rows_per_req[r] consecutive rows), built on the host and cached:
    pad_rows/pad_valid [N, max rows] (each request's rows, padded), first_row [N], row_req/row_rank [rows]."""
    key = (rows_per_req, str(device))
    with _LAYOUTS_LOCK:  # engines in one process (tests, benches) each step in their own thread
        found = _LAYOUTS.get(key)
        if found is not None:
            _LAYOUTS.move_to_end(key)
    if found is None:
        counts = np.asarray(rows_per_req)
        offsets = counts.cumsum() - counts
        slots = np.arange(max(rows_per_req))
        row_req = np.repeat(np.arange(len(rows_per_req)), counts)
        found = {
            "pad_rows": to_device(offsets[:, None] + np.minimum(slots[None, :], counts[:, None] - 1), device),
            "pad_valid": to_device(slots[None, :] < counts[:, None], device, torch.bool),
            "first_row": to_device(offsets, device),
            "row_req": to_device(row_req, device),
            "row_rank": to_device(np.arange(len(row_req)) - offsets[row_req], device),
        }
        _remember(key, found)
    return found


# Layouts by (rows per request, device), LRU first. Bounded in bytes: every new mix of running requests makes one
# (64 requests of beam 64: ~100 KB), so the former cap of 4,096 entries let it grow to ~400 MB at worst.
_LAYOUTS: OrderedDict[tuple, dict[str, torch.Tensor]] = OrderedDict()
_LAYOUTS_LOCK = threading.Lock()
LAYOUT_CACHE_BYTES = 8 << 20
_layout_bytes = 0


def _nbytes(layout: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in layout.values())


def _remember(key: tuple, layout: dict[str, torch.Tensor]) -> None:
    """Keep the layout; forget the least recently used ones while the cache holds over LAYOUT_CACHE_BYTES."""
    global _layout_bytes
    with _LAYOUTS_LOCK:
        old = _LAYOUTS.pop(key, None)  # another engine's thread may have built it meanwhile
        if old is not None:
            _layout_bytes -= _nbytes(old)
        _LAYOUTS[key] = layout
        _layout_bytes += _nbytes(layout)
        while _layout_bytes > LAYOUT_CACHE_BYTES and len(_LAYOUTS) > 1:
            _, old = _LAYOUTS.popitem(last=False)
            _layout_bytes -= _nbytes(old)
