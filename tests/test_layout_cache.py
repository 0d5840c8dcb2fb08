"""The beam search's layout cache stays bounded in bytes however many distinct mixes of requests run (issue 22,
item 8: memory under bursts); it still returns the cached layout for a repeated mix."""

from __future__ import annotations

import torch

from genrec.engine import row_layout as layouts


def _held_bytes() -> int:
    return sum(t.numel() * t.element_size() for layout in layouts._LAYOUTS.values() for t in layout.values())


def test_layouts_bounded_in_bytes_after_many_distinct_mixes():
    device = torch.device("cpu")
    for i in range(400):  # 400 distinct mixes of 64 requests of up to 64 rows: ~100 KB each, ~40 MB unbounded
        layouts.row_layout(tuple(64 - ((i + r) % 7) for r in range(64)) + (i % 64 + 1,), device)
    assert _held_bytes() <= layouts.LAYOUT_CACHE_BYTES
    assert layouts._layout_bytes == _held_bytes()  # the running count matches what is held


def test_repeated_layout_is_reused_and_recent_ones_survive():
    device = torch.device("cpu")
    hot = (3, 1, 2)
    first = layouts.row_layout(hot, device)
    for i in range(300):
        layouts.row_layout(tuple([64] * 64) + (i + 1,), device)
        assert layouts.row_layout(hot, device) is first  # used every step: never the least recently used
    assert layouts.row_layout(hot, device)["row_req"].tolist() == [0, 0, 0, 1, 2, 2]
