"""The execution plan: what differs by device, chosen once when an engine is built (docs/engine.md, 'The execution
plan'). It holds the model's operations (the layer pieces, plain or compiled, and the attention kernels), whether
passes are captured as CUDA graphs at start and how a capture session is opened, the split-KV policy and where a
decode pass selects its beams. The model, the attention and the runner take the plan's parts and never ask which
device they are on; tests build a plan (`ExecutionPlan.build`, `dataclasses.replace`) instead of patching attributes.

The CPU plan: plain pieces, the reference kernels, no graphs, no split. The CUDA plan (half precision): compiled
pieces, FlashAttention-2 (for a decoder's prefill, the kernel measured fastest on the device, or the option's:
genrec.attention.choice), graphs captured in one session (one side stream, one memory pool), split-KV by the blocks
with work against the SMs. A float32 CUDA engine compiles its pieces but runs the reference attention, whose index
tables are read on the host, so it captures no graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

from genrec.attention import FLASH, REFERENCE
from genrec.attention.choice import HeadShape, prefill_choice
from genrec.attention.kernels import prefill_kernels
from genrec.engine.decode_batch import bucket_of, capacity_of, sequences_of
from genrec.model import fused
from genrec.model.kv_pool import MAX_SPANS
from genrec.model.ops import PLAIN_OPS, ModelOps

SplitKV = Literal["off", "on", "auto"]
# Split-KV: a decode pass whose context call would leave most SMs idle cuts each long context into MAX_SPANS chunks
# of at least this many tokens, read in parallel and merged exactly (log-sum-exp). Untuned: gpu_check times it.
SPLIT_MIN_CHUNK = 128


@dataclass(frozen=True)
class ExecutionPlan:
    device: torch.device
    ops: ModelOps = PLAIN_OPS
    graphs: bool = False  # decode and prefill passes captured as CUDA graphs at start, replayed after
    capture: type | None = None  # opens a start-up capture session (`CudaCapture`; tests: a recorder)
    split_kv: SplitKV = "auto"
    sms: int = 0  # the SMs a decode pass's context call should fill (auto); 0: unknown, never split
    selects_in_graph: bool = False  # a captured decode pass selects its beams itself (one sort in the graph)
    fp8: bool = False  # the decoder's linear layers in FP8 (genrec.model.fp8), quantized as the engine loads
    attention_choice: dict | None = None  # how the prefill kernel was chosen (genrec.attention.choice.Choice)

    @classmethod
    def build(
        cls,
        device,
        dtype: torch.dtype,
        fast: bool | None = None,
        split_kv: SplitKV | None = None,
        selects_in_graph: bool = False,
        model_key: str = "",
        fp8: bool = False,
        attention: str | None = None,
        heads: HeadShape | None = None,
    ) -> ExecutionPlan:
        """The plan for an engine on `device` in `dtype`. `fast` (default: on with CUDA): the compiled pieces,
        FlashAttention-2 and graphs where the dtype allows them; no effect on the CPU. `split_kv`: default auto.
        `model_key`: the model's shape (its config): engines of one key share their compiled pieces. `fp8`: the
        linear layers in FP8, where the device multiplies FP8 (the CPU does, slowly: for tests). `attention`: the
        prefill kernel of a fast plan, `auto` (default: measured) or one of `PREFILL_KERNEL_NAMES`; `heads`: a
        decoder's attention shape, which the measurement runs (None: FlashAttention-2, unmeasured)."""
        device, split_kv = torch.device(device), split_kv or "auto"
        if fp8 and device.type == "cuda":
            check_fp8(torch.cuda.get_device_capability(device))
        fast = device.type == "cuda" and (fast is None or fast)
        if not fast:
            return cls(device, split_kv=split_kv, fp8=fp8)
        graphs = dtype in (torch.float16, torch.bfloat16)  # FlashAttention-2 runs in half precision only
        ops = ModelOps(fused.compiled(key=f"{dtype} {model_key}"), FLASH if graphs else REFERENCE)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if graphs else 0
        capture = CudaCapture if graphs else None
        choice = None
        if graphs and heads is not None:
            choice = prefill_choice(attention, heads, device, dtype, prefill_kernels(device))
            ops = replace(ops, attention=choice.kernels)
        described = choice.describe() if choice else None
        return cls(device, ops, graphs, capture, split_kv, sms, selects_in_graph and graphs, fp8, described)

    @property
    def compiles(self) -> bool:
        """Whether its pieces compile (then the engine warms them up on its own requests at start)."""
        return self.ops.pieces is not fused.PLAIN

    def splits(self, rows_per_context: list[int], longest_context: int, heads: int) -> bool:
        """Whether a decode pass of one-span contexts runs split (the multi-span bucket, each context cut into up to
        MAX_SPANS chunks): `on` whenever a context can be cut; `auto` when the split call would run in at most two
        waves of the SMs (the pass as it is leaves most of them idle); never `off`."""
        if self.split_kv == "off" or longest_context < 2 * SPLIT_MIN_CHUNK:
            return False
        if self.split_kv == "on":
            return True
        blocks = sum(self.query_blocks(rows) for rows in rows_per_context) * heads
        return 0 < blocks * MAX_SPANS <= 2 * self.sms

    def capacity(self, rows_per_context: list[int]) -> int:
        """The sequence capacity (per span) of the captured decode pass that holds these contexts' rows: each one's
        rows cut into the attention's query blocks, rounded up to a power of two. FlashAttention-2 launches a thread
        block per query block and sequence of the capacity, so the blocks launched stay within twice those with work."""
        return capacity_of(sequences_of(rows_per_context, self.ops.attention.query_block))

    def capacities(self, bucket: int, max_requests: int) -> list[int]:
        """The capacities captured for a row bucket: from what its fewest rows need to what its most rows of
        `max_requests` requests may need."""
        block = self.ops.attention.query_block
        fewest = sequences_of([bucket // 2 + 1], block) if bucket > bucket_of(1) else 1
        most = min(bucket, sequences_of([bucket], block) + max_requests)
        sizes = [capacity_of(fewest)]
        while sizes[-1] < most:
            sizes.append(sizes[-1] * 2)
        return sizes

    def query_blocks(self, rows: int) -> int:
        """The attention's thread blocks for one context's `rows` queries, per head (1 where a block holds any)."""
        block = self.ops.attention.query_block
        return 1 if block is None else -(-rows // block)

    def describe(self) -> dict:
        """What /v1/model and gpu_check say of it."""
        return {
            "attention": self.ops.attention.name,
            "compiled_pieces": self.compiles,
            "cuda_graphs": self.graphs,
            "split_kv": self.split_kv,
            "selects_in_graph": self.selects_in_graph,
            "fp8_linears": self.fp8,
            "attention_choice": self.attention_choice,
        }


def check_fp8(capability: tuple[int, int]) -> None:
    """FP8 products (torch._scaled_mm) need compute capability 8.9 or later: refused before any weight is read."""
    if capability < (8, 9):
        raise ValueError(
            f"fp8: this GPU (compute capability {capability[0]}.{capability[1]}) has no FP8 matrix products; they need"
            " 8.9 or later (H100, H200, L4); leave fp8 out"
        )


class CudaCapture:
    """One start-up capture session on the engine's device (current): every graph captured on ONE side stream into
    ONE memory pool, so the caching allocator reuses one graph's freed blocks in the next (it reuses a block only on
    the stream that freed it), and the graphs, captured largest first and replayed one at a time, share them."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs = 0

    def graph(self, forward) -> CudaGraph:
        self.graphs += 1
        return CudaGraph(forward, self.stream, self.pool)


class CudaGraph:
    """A pass captured as a CUDA graph: `replay()` reruns it on its buffers; `outputs`: what the pass returned."""

    def __init__(self, forward, stream: torch.cuda.Stream, pool):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()  # warm-up outside the capture (lazy initialisations, autotuning)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA call cannot invalidate this capture (a second guard: captures run
        # at engine start, before any request, and nothing outside the engine's thread issues device work).
        with torch.cuda.graph(self.graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            self.outputs = forward()

    def replay(self) -> None:
        self.graph.replay()
