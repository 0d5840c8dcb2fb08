"""The decode captures' size, worked out at start when `cuda_graph_max_rows` is unset: the demand (requests × the
widest beam) as far as the pool, the grid and the memory allow; and an engine that captures uses it."""

from types import SimpleNamespace

import torch

from genrec.api import MAX_BEAM_WIDTH
from genrec.engine import Engine
from genrec.engine.capture_size import GRID_ROWS, MEMORY_SHARE, decode_bytes_per_row, rows_to_capture
from genrec.engine.scheduler import SchedulerConfig
from genrec.model.directory import ModelDir
from tests.plans import graphed_plan
from tests.test_graph_capture import RecordedGraph

PLENTY = 1 << 50


def test_with_room_it_captures_every_request_at_the_widest_beam():
    assert rows_to_capture(8, 3, PLENTY, 1000, PLENTY) == 8 * MAX_BEAM_WIDTH


def test_the_grid_the_pool_and_the_memory_each_cap_it_to_a_power_of_two():
    assert rows_to_capture(64, 3, PLENTY, 1000, PLENTY) == GRID_ROWS
    assert rows_to_capture(8, 3, 3000, 1000, PLENTY) == 512  # 1,000 rows' own tokens fit: 512
    per_row = 400_000
    memory = 3000 * per_row * MEMORY_SHARE  # 3,000 rows' working set in the share: 2,048
    assert rows_to_capture(8, 3, PLENTY, per_row, memory) == 2048
    assert rows_to_capture(8, 3, PLENTY, per_row, 0) == 16  # never below the smallest bucket


def test_a_row_of_qwen3_1_7b_is_mostly_its_vocabulary_wide_logits():
    """Qwen3-1.7B in bf16 with 257 columns: ~490 KB a row, 304 KB of it logits and 115 KB its new K/V of 28 layers;
    8,192 rows take ~4 GB."""
    dims = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_attention_heads=16)
    config = SimpleNamespace(**dims, num_key_value_heads=8, head_dim=128, num_hidden_layers=28)
    per_row = decode_bytes_per_row(config, 2, 257)
    assert 2 * 151936 + 2 * 28 * 8 * 128 * 2 < per_row < 2 * 151936 * 1.7
    assert rows_to_capture(8, 3, PLENTY, per_row, 60 << 30) == 8192  # an H200's free half after the pool


def test_an_engine_without_the_option_captures_what_its_start_works_out(tiny_dir):
    """Nothing in the options: the start captures every bucket up to the derived rows (here the small pool's), and
    /v1/model says which."""
    config = SchedulerConfig(max_running=2, kv_budget_bytes=1 << 18)
    engine = Engine.from_pretrained(tiny_dir, scheduler=config, plan=graphed_plan(RecordedGraph))
    engine.start()
    runner = engine.runner
    model = ModelDir.open(tiny_dir)
    per_row = decode_bytes_per_row(model.config, torch.float32.itemsize, engine.family.max_children)
    pool = engine.scheduler.budget.pool
    expected = rows_to_capture(2, engine.family.levels, pool.tokens, per_row, PLENTY)
    assert runner.graph_max_rows == expected < 2 * MAX_BEAM_WIDTH  # the pool's cap
    assert expected == 1 << ((pool.tokens // engine.family.levels).bit_length() - 1)
    assert max(key[1] for key in runner._captured) == expected
    assert engine.describe_execution()["graph_max_rows"] == expected
