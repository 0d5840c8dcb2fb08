"""The decoder architectures the semantic-ID family runs: one implementation (model/qwen3.py), configured.

Qwen3 (OpenOneRec's base) and Qwen2 (Qwen2.5: MiniOneRec's base) differ in attention only: Qwen3 normalises each
query and key head (RMSNorm) before RoPE; Qwen2 has no such norm and adds biases to the q, k and v projections.
Everything else (RMSNorm, SwiGLU MLP, RoPE, grouped-query attention, a tied or untied head) is the same, so an
architecture is a few switches, read once when the model is built.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecoderArchitecture:
    model_type: str  # config.json's model_type
    hf_class: str  # config.json's architectures[0]: the transformers class that is the numerical reference
    qk_norm: bool  # an RMSNorm over each query and key head before RoPE
    qkv_bias: bool  # biases on the q, k and v projections whatever config.json says
    reads_attention_bias: bool  # config.json's attention_bias applies (Qwen3: biases on q/k/v/o; Qwen2 ignores it)


QWEN3 = DecoderArchitecture("qwen3", "Qwen3ForCausalLM", qk_norm=True, qkv_bias=False, reads_attention_bias=True)
QWEN2 = DecoderArchitecture("qwen2", "Qwen2ForCausalLM", qk_norm=False, qkv_bias=True, reads_attention_bias=False)
ARCHITECTURES = {arch.model_type: arch for arch in (QWEN3, QWEN2)}
