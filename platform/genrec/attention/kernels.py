"""The attention kernels an execution plan runs (genrec.engine.plan): the reference everywhere; on CUDA in half
precision FlashAttention-2, or for prefill a kernel chosen by measurement (`PREFILL_KERNELS`, genrec.attention.choice),
decode's static call staying FlashAttention-2's. Model and attention code call a plan's kernels and never ask which
device they are on.

`varlen` serves passes whose index tables the host builds per pass (prefill, scoring): `(q, k, v, spans, scale,
causal=False, need_lse=True) -> (out, lse)`. `static` serves a decode pass replayed as a CUDA graph, its index tables
fixed-size device tensors: `(q, k, v, cu_q, cu_k, used_k, row_empty, max_q, max_k, scale) -> (out, lse)`, where
`max_q` is frozen into the graph, so a static call's sequences hold at most `query_block` queries each (None: any).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from genrec.attention.prefill_kernels import cudnn_available, cudnn_varlen, flash3_available, flash3_varlen
from genrec.attention.static import FLASH_MAX_SEQUENCES, FLASH_QUERY_BLOCK, static_flash, static_reference
from genrec.attention.varlen import flash_varlen, varlen_reference


@dataclass(frozen=True)
class AttentionKernels:
    name: str
    varlen: Callable
    static: Callable
    query_block: int | None  # the most queries one sequence of a static call may hold (None: any)
    max_sequences: int | None = None  # the most sequences one static call may hold (None: any)

    def static_max_q(self, queries: int) -> int:
        """The `max_q` a static call over `queries` packed rows passes: its launch grid's query blocks."""
        return queries if self.query_block is None else min(queries, self.query_block)


REFERENCE = AttentionKernels("reference", varlen_reference, static_reference, None)
FLASH = AttentionKernels("flash_attention_2", flash_varlen, static_flash, FLASH_QUERY_BLOCK, FLASH_MAX_SEQUENCES)
CUDNN = AttentionKernels("cudnn_attention", cudnn_varlen, static_flash, FLASH_QUERY_BLOCK, FLASH_MAX_SEQUENCES)
FLASH3 = AttentionKernels("flash_attention_3", flash3_varlen, static_flash, FLASH_QUERY_BLOCK, FLASH_MAX_SEQUENCES)


def prefill_kernels(device) -> dict[str, AttentionKernels]:
    """The CUDA plan's candidates on this device, by name: FlashAttention-2 first (kept on a tie), then cuDNN
    attention and FlashAttention-3 where they run."""
    available = {FLASH.name: True, CUDNN.name: cudnn_available(device), FLASH3.name: flash3_available(device)}
    return {k.name: k for k in (FLASH, CUDNN, FLASH3) if available[k.name]}


PREFILL_KERNEL_NAMES = (FLASH.name, CUDNN.name, FLASH3.name)  # what the option `attention` may name
