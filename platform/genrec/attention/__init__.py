"""Shared-context attention (docs/design.md, 'Shared-context attention'): each row attends to its request's
context K/V (stored once) plus its own short causal suffix. `merge`: the suffix part and the exact log-sum-exp
merge; `varlen`: the context part of many requests in one call over a token-major pool; `rows`: which rows read
which context (once per pass); `static`: the same call over fixed-size index tensors, for CUDA-graph decode;
`kernels`: what an execution plan runs (the reference, or FlashAttention-2 on CUDA).
"""

from genrec.attention.kernels import FLASH, REFERENCE, AttentionKernels
from genrec.attention.merge import shared_context_attention
from genrec.attention.rows import ContextGroup, ContextRows, PrefillRows
from genrec.attention.static import StaticContext, StaticRows
from genrec.attention.varlen import Spans, context_attention, flash_varlen, varlen_reference

__all__ = [
    "FLASH",
    "REFERENCE",
    "AttentionKernels",
    "ContextGroup",
    "ContextRows",
    "PrefillRows",
    "Spans",
    "StaticContext",
    "StaticRows",
    "context_attention",
    "shared_context_attention",
    "flash_varlen",
    "varlen_reference",
]
