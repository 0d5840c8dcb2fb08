"""Shared-context attention (docs/design.md, 'Shared-context attention'): each row attends to its request's
context K/V (stored once) plus its own short causal suffix. `merge`: the suffix part and the exact log-sum-exp
merge; `varlen`: the context part of many requests in one call over a token-major pool; `rows`: which rows read
which context (once per pass); `static`: the same call over fixed-size index tensors, for CUDA-graph decode.
"""

from genrec.attention.merge import shared_context_attention
from genrec.attention.rows import ContextGroup, ContextRows, PrefillRows
from genrec.attention.static import StaticContext, StaticRows, varlen_op
from genrec.attention.varlen import Spans, context_attention, varlen_attention, varlen_reference

__all__ = [
    "ContextGroup",
    "ContextRows",
    "PrefillRows",
    "Spans",
    "StaticContext",
    "StaticRows",
    "context_attention",
    "shared_context_attention",
    "varlen_attention",
    "varlen_op",
    "varlen_reference",
]
