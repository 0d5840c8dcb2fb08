"""Execution plans for the CPU suite: the CUDA plan's Python (graph capture, sequence capacities, split-KV, compiled
pieces) run on the CPU with stand-ins, swapped in as a plan (`Engine.from_pretrained(plan=...)`), never patched."""

from __future__ import annotations

import dataclasses

import torch

from genrec.attention import AttentionKernels, varlen_reference
from genrec.attention.static import FLASH_MAX_SEQUENCES, FLASH_QUERY_BLOCK, static_flash
from genrec.engine.plan import ExecutionPlan
from genrec.model.fused import PLAIN
from genrec.model.ops import ModelOps

# FlashAttention-2 as the CPU can run it: the static call's contract emulated (its grid's reach and limit, rows it
# leaves unwritten: genrec.attention.static.static_flash), the per-pass varlen call by the reference.
FLASH_ON_CPU = AttentionKernels(
    "flash_attention_2 (emulated)", varlen_reference, static_flash, FLASH_QUERY_BLOCK, FLASH_MAX_SEQUENCES
)
CUDA_OPS_ON_CPU = ModelOps(PLAIN, FLASH_ON_CPU)


class RecordingCapture:
    """A start-up capture session that 'captures' with `graph_class` (e.g. tests.test_graph_capture.RecordedGraph),
    counting the sessions opened (CUDA's: one side stream and one pool each)."""

    opened = 0
    graph_class = None

    def __init__(self, device):
        RecordingCapture.opened += 1
        self.graphs = 0

    def graph(self, forward):
        self.graphs += 1
        return self.graph_class(forward)


def graphed_plan(graph_class, ops: ModelOps = CUDA_OPS_ON_CPU, **fields) -> ExecutionPlan:
    """The CUDA plan's shape on the CPU: passes captured at start (by `graph_class`) and replayed after."""
    session = type("Capture", (RecordingCapture,), {"graph_class": staticmethod(graph_class)})
    return ExecutionPlan(torch.device("cpu"), ops, graphs=True, capture=session, **fields)


def with_split(plan: ExecutionPlan, split_kv: str) -> ExecutionPlan:
    return dataclasses.replace(plan, split_kv=split_kv)


class TracedGraph:
    """A CPU stand-in for a CUDA graph that replays a record, never the Python: at capture the pass is traced once
    (make_fx, real mode) over the static buffers, each tensor it reads a reference held by the record (as a graph
    holds device addresses) and the attention's custom op one opaque node; a replay runs the record. So a value the
    Python froze at capture (a host tensor, a Python number, a buffer rebound after capture) is replayed frozen, as on
    CUDA, and a host sync inside the pass fails the capture."""

    made: list = []

    def __init__(self, forward):
        from torch.fx.experimental.proxy_tensor import make_fx

        self.record = make_fx(lambda: forward(), tracing_mode="real")()  # its defaults bound, as the runner calls it
        self.outputs, self.replays = None, 0
        TracedGraph.made.append(self)

    def replay(self) -> None:
        self.record()
        self.replays += 1
