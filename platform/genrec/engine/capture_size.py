"""How many rows the largest decode pass captured at start holds, when the options do not say (`cuda_graph_max_rows`):
worked out from what the engine may be asked and what it can hold, once, as it starts.

The demand: `max_requests` requests (the scheduler's `max_running`) of the widest beam the API takes. The limits: the
KV pool (each row's own tokens take `levels` slots of it), CUDA's grid (a pass's attention call launches at most
65,535 sequences: tests/test_launch_geometry.py), and memory: the graphs share one pool, so what they take is about
the largest pass's own working set, which may use a quarter of the memory left free once the KV pool is allocated.
"""

from __future__ import annotations

from genrec.api import MAX_BEAM_WIDTH
from genrec.engine.decode_batch import bucket_of

GRID_ROWS = 16384  # the most rows whose pass, every span at its largest capacity, fits CUDA's grid.y
MEMORY_SHARE = 4  # the captured passes may take 1 / MEMORY_SHARE of the memory free after the KV pool


def decode_bytes_per_row(config, itemsize: int, columns: int) -> int:
    """An upper estimate of the device memory one row of a decode pass holds at once: its logits over the whole
    vocabulary (the head's output, which the column log-probabilities read), one layer's activations (the residual
    and its norm, the attention's projections and output, the MLP's gate, up and their product), its new K/V of every
    layer (stacked, then written into the pool inside the pass) and the float32 per-column buffers (gains,
    candidates, sort keys)."""
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    layer = 4 * config.hidden_size + 2 * heads * head_dim + 2 * kv_heads * head_dim + 3 * config.intermediate_size
    new_kv = 2 * config.num_hidden_layers * kv_heads * head_dim
    return itemsize * (config.vocab_size + layer + new_kv) + 3 * 8 * columns


def rows_to_capture(max_requests: int, levels: int, pool_tokens: int, bytes_per_row: int, free_bytes: int) -> int:
    """The rows of the largest captured decode pass: a power of two (the row buckets'), at least the smallest bucket,
    at most what the demand, the pool, the grid and the memory allow."""
    demand = max_requests * MAX_BEAM_WIDTH
    fits = free_bytes // MEMORY_SHARE // bytes_per_row
    rows = min(demand, pool_tokens // max(levels, 1), GRID_ROWS, fits)
    smallest = bucket_of(1)
    return max(smallest, 1 << (max(rows, 1).bit_length() - 1))
