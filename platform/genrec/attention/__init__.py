"""Shared-context attention: the primitive behind beam decode, multi-candidate scoring and chunked prefill.

R rows belong to requests. Each row attends to

    [ its request's context K/V (the prompt, stored once) ] + [ its own short suffix K/V (causal) ]

By concern:
- `merge`: the suffix part and the exact log-sum-exp merge with the context part;
- `varlen`: the context part of many requests in one call over a token-major pool (plain-torch reference,
  and FlashAttention-2 varlen on CUDA when the engine's `fast` option asks for it);
- `rows`: which rows of a pass read which pooled context (built once per pass, used by every layer);
- `static`: the same context call over fixed-size index tensors, one call per layer whatever the spans, for a
  decode pass a CUDA graph replays.
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
