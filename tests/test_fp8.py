"""The FP8 linear layers (opt-in `fp8`): their logic on the CPU, which runs torch._scaled_mm as CUDA does (its speed is
measured only where a GPU is lent: gpu_check)."""

import pytest
import torch

from genrec.api import RetrieveRequest
from genrec.engine import Engine, SchedulerConfig
from genrec.engine.plan import check_fp8
from genrec.engine_options import EngineOptions
from genrec.model.fp8 import Fp8Linear, quantize_rows
from tests.conftest import random_prompt


@pytest.fixture
def g():
    return torch.Generator().manual_seed(0)


def fake_quantized(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the product rounds it: to e4m3 codes with a scale per row, then back."""
    codes, scales = quantize_rows(x)
    return codes.float() * scales


@pytest.mark.parametrize("bias", [False, True])
def test_the_fp8_product_is_the_exact_product_of_its_two_roundings(g, bias):
    """Against the dequantised reference: the weight's codes times its scales, the input rounded per row the same
    way, multiplied in float32. What remains is the order of the float32 sums."""
    weight, x = torch.randn(48, 32, generator=g), torch.randn(5, 3, 32, generator=g) * 7
    b = torch.randn(48, generator=g) if bias else None
    layer = Fp8Linear(weight, b)
    got = layer(x)
    want = torch.nn.functional.linear(fake_quantized(x.reshape(15, 32)).view(5, 3, 32), layer.dequantized(), b)
    assert got.shape == (5, 3, 48) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and it approximates the unrounded product within e4m3's relative step (2^-4 per operand)
    exact = torch.nn.functional.linear(x, weight, b)
    assert (got - exact).abs().max() < 0.1 * exact.abs().max()


def test_each_weight_row_and_input_row_uses_the_formats_range(g):
    weight = torch.randn(8, 16, generator=g) * torch.logspace(-3, 3, 8)[:, None]  # rows six decades apart
    codes, scales = quantize_rows(weight)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (8, 1)
    assert torch.allclose(codes.float().abs().amax(dim=1), torch.full((8,), 448.0))  # each row's largest at the top
    relative = (codes.float() * scales - weight).abs() / weight.abs().amax(dim=1, keepdim=True)
    assert relative.max() < 2**-4  # a per-row scale keeps small rows precise
    zeros, zero_scales = quantize_rows(torch.zeros(2, 4))
    assert (zeros.float() == 0).all() and (zero_scales > 0).all()  # an all-zero row: codes 0, never 0/0


def test_an_fp8_engine_returns_the_float32_engines_beams_within_fp8s_noise(tiny_dir):
    """The whole decoder in FP8 (q/k/v, o, gate/up, down of every layer; the head in float32): the same beams as
    the float32 engine, each log-probability within a share of the spread of the log-probabilities (FP8 rounds at
    2^-4, bf16 at 2^-8: gpu_check's bf16 allowance is |t_k| / 32)."""
    config = SchedulerConfig(prefix_cache_bytes=0)
    exact = Engine.from_pretrained(tiny_dir, scheduler=config)
    fp8 = Engine.from_pretrained(tiny_dir, scheduler=config, fp8=True)
    layer = fp8.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv, Fp8Linear) and isinstance(layer.mlp.down_proj, Fp8Linear)
    assert layer.self_attn.q_proj is None  # the float weights are dropped
    assert fp8.describe_execution()["fp8_linears"] and not exact.describe_execution()["fp8_linears"]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        request = RetrieveRequest(prompt_token_ids=random_prompt(exact, 40, g), beam_width=20)
        (want,), (got,) = exact.retrieve([request]), fp8.retrieve([request])
        want_lp = {item.item_id: item.logprob for item in want.items}
        got_lp = {item.item_id: item.logprob for item in got.items}
        allowance = abs(min(want_lp.values())) / 12
        assert len(want_lp.keys() & got_lp.keys()) >= 16  # near-ties at the cut may swap a few
        assert max(abs(want_lp[k] - got_lp[k]) for k in want_lp.keys() & got_lp.keys()) < allowance


def test_fp8_is_opt_in_and_refused_where_it_cannot_run(hstu_dir):
    assert "fp8" not in EngineOptions().engine_kwargs()  # off: a batch run's identity is unchanged
    assert EngineOptions(fp8=True).engine_kwargs()["fp8"] is True
    check_fp8((9, 0))  # H100 / H200
    check_fp8((8, 9))  # L4, RTX 40
    with pytest.raises(ValueError, match=r"compute capability 8\.0\) has no FP8"):
        check_fp8((8, 0))  # A100
    with pytest.raises(ValueError, match="only a Qwen3 decoder"):
        Engine.from_pretrained(hstu_dir, fp8=True)
