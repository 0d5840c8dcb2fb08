"""A GPU hazard caught on the CPU: the thread blocks a decode pass's context call launches. FlashAttention-2 launches
ceil(max_q / 128) x sequences x heads blocks, frozen into a captured graph; a block whose query rows or keys are empty
exits at once, but a pass that launches thousands of them per layer pays for each (the review of 2026-12-06 counted
524,544 launched for 4,096 with work in a batch-of-8 pass). Here every static call of the engine's own decode passes
is recorded (the kernels the CUDA plan runs, their FlashAttention-2 contract emulated on the CPU) and its launch is
held to twice its blocks with work, at gpu_check's shapes; a plan with the old geometry (one sequence per row of the
bucket, max_q every row) is shown to fail the same check.
"""

import dataclasses
import math

import pytest
import torch

from genrec.api import RetrieveRequest
from genrec.attention import AttentionKernels
from genrec.engine import Engine, SchedulerConfig
from genrec.engine.decode_batch import DecodeBatch
from genrec.engine.plan import ExecutionPlan
from genrec.engine_options import EngineOptions
from genrec.model.fused import PLAIN
from genrec.model.kv_pool import MAX_SPANS
from genrec.model.ops import ModelOps
from genrec_bench import gpu_check
from tests.conftest import random_prompt
from tests.plans import FLASH_ON_CPU

BLOCK = 128  # FlashAttention-2's query rows per thread block


@dataclasses.dataclass
class Launch:
    launched: int  # thread blocks per head
    with_work: int  # those whose sequence has queries and keys
    sequences: int  # grid.y


class LaunchRecorder:
    """The FlashAttention-2 kernels of the CUDA plan (emulated), each static call's launch recorded."""

    def __init__(self, kernels: AttentionKernels = FLASH_ON_CPU):
        self.calls: list[Launch] = []
        self.kernels = dataclasses.replace(kernels, static=self._static)
        self._run = kernels.static

    def _static(self, q, k, v, cu_q, cu_k, used_k, row_empty, max_q, max_k, scale):
        rows, used = torch.diff(cu_q).tolist(), used_k.tolist()
        work = sum(math.ceil(n / BLOCK) for n, keys in zip(rows, used, strict=True) if n and keys)
        self.calls.append(Launch(math.ceil(max_q / BLOCK) * len(used), work, len(used)))
        return self._run(q, k, v, cu_q, cu_k, used_k, row_empty, max_q, max_k, scale)


class OldGeometry(ExecutionPlan):
    """Today's geometry before the fix, planted: every row of the bucket a possible sequence, max_q every row."""

    def capacity(self, rows_per_context):
        return None  # DecodeBatch's default: one sequence per row of the bucket

    def capacities(self, bucket, max_requests):
        return [None]


def planted(recorder: LaunchRecorder, **fields) -> ExecutionPlan:
    kernels = dataclasses.replace(recorder.kernels, query_block=None)
    return OldGeometry(torch.device("cpu"), ModelOps(PLAIN, kernels), **fields)


def decoded(engine: Engine, context: int, widths: list[int]) -> None:
    """Requests of `widths` beams over `context`-token prompts, decoded to their end in bucketed passes (the shapes a
    captured graph replays) through the engine's runner."""
    g = torch.Generator().manual_seed(context + len(widths))
    prepared = [
        engine.prepare(RetrieveRequest(prompt_token_ids=random_prompt(engine, context, g), beam_width=w))
        for w in widths
    ]
    pool = engine.runner.new_pool(len(widths) * (context + 4096))
    cohorts = gpu_check.pooled_cohorts(engine, prepared, pool)
    while not all(c.done for c in cohorts):
        engine.runner.decode([c for c in cohorts if not c.done], bucketed=True)


# gpu_check's shapes: beam 256 at contexts 1,000 and 5,000; one request, four callers, a batch of 8.
SHAPES = [(1000, [256]), (5000, [256]), (1000, [256] * 4), (5000, [256] * 4), (1000, [256] * 8), (5000, [256] * 8)]


def engine_with(tiny_dir, plan: ExecutionPlan) -> Engine:
    return Engine.from_pretrained(tiny_dir, plan=plan, scheduler=SchedulerConfig(prefix_cache_bytes=0))


def worst_ratio(calls: list[Launch]) -> float:
    return max(c.launched / c.with_work for c in calls if c.with_work)


@pytest.mark.parametrize("split_kv", ["off", "auto"])
@pytest.mark.parametrize(("context", "widths"), SHAPES, ids=[f"{c}x{len(w)}" for c, w in SHAPES])
def test_a_decode_pass_launches_at_most_twice_the_blocks_with_work(tiny_dir, context, widths, split_kv):
    recorder = LaunchRecorder()
    plan = ExecutionPlan(torch.device("cpu"), ModelOps(PLAIN, recorder.kernels), split_kv=split_kv, sms=132)
    decoded(engine_with(tiny_dir, plan), context, widths)
    assert recorder.calls and worst_ratio(recorder.calls) <= 2.0, recorder.calls
    if split_kv == "auto" and context == 5000 and len(widths) == 1:
        assert any(c.sequences % MAX_SPANS == 0 and c.sequences > MAX_SPANS for c in recorder.calls)  # it split


def test_the_old_geometry_fails_the_same_check(tiny_dir):
    """The planted defect: one sequence slot per row of the bucket, max_q every row; one request of beam 256."""
    recorder = LaunchRecorder()
    decoded(engine_with(tiny_dir, planted(recorder, split_kv="off")), 1000, [256])
    assert worst_ratio(recorder.calls) > 2.0


def test_a_pass_at_the_most_rows_the_options_allow_fits_the_grid(tiny_dir):
    """grid.y (a call's sequences) stays within CUDA's 65,535 at the largest captured pass the options allow, with
    every span and the largest capacity its rows may need; the old geometry did not (4 x 16,385 at 16,384 rows)."""
    most = EngineOptions.model_fields["cuda_graph_max_rows"].metadata
    rows = next(m.le for m in most if hasattr(m, "le"))
    engine = engine_with(tiny_dir, ExecutionPlan(torch.device("cpu"), ModelOps(PLAIN, FLASH_ON_CPU)))
    pool = engine.runner.new_pool(64)
    capacity = max(engine.plan.capacities(rows, max_requests=64))
    batch = DecodeBatch(rows, 1, pool, engine.plan.ops, MAX_SPANS, 1, False, capacity)
    assert batch.context.cu_q.numel() - 1 <= FLASH_ON_CPU.max_sequences
    old = DecodeBatch(rows, 1, pool, engine.plan.ops, MAX_SPANS, 1, False, None)
    assert old.context.cu_q.numel() - 1 > FLASH_ON_CPU.max_sequences


def test_a_call_whose_grid_does_not_reach_its_rows_leaves_them_nan_and_fails_loudly(tiny_dir):
    """The emulation's own contract: rows past max_q's query blocks are never written (NaN here): a pass that froze
    too small a max_q shows in its results, not only in a count."""
    from genrec.attention.static import static_flash

    q, k = torch.randn(300, 2, 8), torch.randn(400, 1, 8)
    cu_q, cu_k = torch.tensor([0, 300], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32)
    used, empty = torch.tensor([400], dtype=torch.int32), torch.zeros(300, dtype=torch.bool)
    out, lse = static_flash(q, k, k, cu_q, cu_k, used, empty, 128, 400, 0.3)
    assert torch.isfinite(out[:128]).all() and torch.isnan(out[128:]).all() and torch.isnan(lse[:, 128:]).all()
    whole, _ = static_flash(q, k, k, cu_q, cu_k, used, empty, 300, 400, 0.3)
    assert torch.isfinite(whole).all()
