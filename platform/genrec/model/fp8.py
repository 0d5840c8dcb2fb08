"""A decoder's linear layers in FP8 (opt-in: the engine option `fp8`): each weight quantized once, at load, to
float8 e4m3 with a scale per output channel; each product's input quantized as it comes, with a scale per row (per
token), and the product run by `torch._scaled_mm` in float32 accumulation, its output in the model's dtype. The LM
head stays in the model's dtype: the beam search ranks by its log-probabilities.

The error is the two roundings (e4m3 keeps 3 mantissa bits: a relative step of 2^-4 at most, 2^-5 on average);
`dequantized` gives the exact product it approximates, which the tests hold it to.
"""

from __future__ import annotations

import torch
from torch import nn

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
TINY_SCALE = 1e-12  # an all-zero row's scale: its codes stay 0, never 0/0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, k] -> (codes [n, k] float8 e4m3, scales [n, 1] float32): x ≈ codes * scales, each row's largest
    magnitude at the format's largest."""
    scales = (x.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).clamp_min(TINY_SCALE)
    return (x.float() / scales).to(torch.float8_e4m3fn), scales


class Fp8Linear(nn.Module):
    """`F.linear(x, weight, bias)` with the weight held in FP8 ([out, in] codes, a float32 scale per output row)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        codes, scales = quantize_rows(weight)
        self.register_buffer("codes_t", codes.t())  # [in, out], column-major: the layout _scaled_mm takes
        self.register_buffer("scales", scales.t().contiguous())  # [1, out]
        self.register_buffer("bias", bias)
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        codes, scales = quantize_rows(x.reshape(-1, x.shape[-1]))
        out = torch._scaled_mm(codes, self.codes_t, scale_a=scales, scale_b=self.scales, out_dtype=x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*lead, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight it multiplies by, [out, in] float32."""
        return (self.codes_t.float() * self.scales).t()


def quantize_linears(model) -> None:
    """A Qwen3 model's (`genrec.model.qwen3.Qwen3`, fused) decoder linears in FP8, in place: q/k/v, o, gate/up and
    down of every layer; the embedding and the LM head untouched. The half-precision weights are dropped."""
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        attention.qkv = Fp8Linear(attention.qkv.weight, attention.qkv.bias)
        attention.o_proj = Fp8Linear(attention.o_proj.weight, attention.o_proj.bias)
        mlp.gate_up = Fp8Linear(mlp.gate_up.weight, None)
        mlp.down_proj = Fp8Linear(mlp.down_proj.weight, None)
        attention.q_proj = attention.k_proj = attention.v_proj = mlp.gate_proj = mlp.up_proj = None
