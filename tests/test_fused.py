"""The fused layer pieces (genrec.model.fused) against their unfused formulas, written out here independently, on
random inputs in float32 and bfloat16; the CPU runs them eagerly, never compiled."""

import pytest
import torch

from genrec.api import RetrieveRequest
from genrec.engine import Engine, SchedulerConfig
from genrec.model import fused
from genrec.model.directory import ModelDir
from genrec.model.kv_pool import KVPool
from genrec.model.ops import PLAIN_OPS
from genrec.model.qwen3 import ContextKV
from genrec_bench import kernels
from tests.conftest import random_prompt

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape, dtype, g):
    return torch.randn(*shape, generator=g).to(dtype)


def rms_reference(x, weight, eps):
    """transformers' Qwen3RMSNorm, step by step."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def layer_norm_reference(x, weight, bias, eps):
    h = x.float()
    mean = h.mean(-1, keepdim=True)
    var = (h - mean).pow(2).mean(-1, keepdim=True)
    return ((h - mean) / torch.sqrt(var + eps) * weight.float() + bias.float()).to(x.dtype)


def rotation_reference(x, theta):
    """RoPE as a complex rotation of the pairs (x_i, x_{i + D/2}) by the angles theta [..., D/2]."""
    half = x.shape[-1] // 2
    pairs = torch.complex(x[..., :half].double(), x[..., half:].double())
    turned = pairs * torch.polar(torch.ones_like(theta.double()), theta.double()).unsqueeze(-2)
    return torch.cat([turned.real, turned.imag], dim=-1)


def close(got, want, dtype):
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.fixture
def g():
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_the_residual_add_then_the_norm(dtype, g):
    x, residual, weight = (
        randn(7, 3, 64, dtype=dtype, g=g),
        randn(7, 3, 64, dtype=dtype, g=g),
        randn(64, dtype=dtype, g=g),
    )
    normed, h = fused.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(h, x + residual) and normed.dtype == dtype
    close(normed, rms_reference(x + residual, weight, 1e-6), dtype)
    close(fused.rms_norm(x, weight, 1e-6), rms_reference(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_normalises_each_head_then_rotates(dtype, g):
    R, heads, D = 5, 6, 16
    qk, weight = randn(R, 2, heads, D, dtype=dtype, g=g), randn(heads, D, dtype=dtype, g=g)
    theta = torch.rand(R, 2, D // 2, generator=g) * 50
    cos, sin = torch.cat([theta, theta], -1).cos().to(dtype), torch.cat([theta, theta], -1).sin().to(dtype)
    got = fused.qk_norm_rope(qk, weight, cos, sin, 1e-6)
    assert got.shape == qk.shape and got.dtype == dtype
    normed = rms_reference(qk, weight, 1e-6)
    close(got, rotation_reference(normed, theta), dtype)
    close(fused.rope(qk, cos, sin), rotation_reference(qk, theta), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_gates_the_up_half(dtype, g):
    gate_up = randn(4, 1, 96, dtype=dtype, g=g)
    gate, up = gate_up[..., :48].float(), gate_up[..., 48:].float()
    close(fused.silu_mul(gate_up), gate * torch.sigmoid(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hstu_pieces_equal_their_formulas(dtype, g):
    R, H, D = 9, 4, 8
    w, b = randn(H * D, dtype=dtype, g=g), randn(H * D, dtype=dtype, g=g)
    x, residual = randn(R, H * D, dtype=dtype, g=g), randn(R, H * D, dtype=dtype, g=g)
    normed, h = fused.add_layer_norm(x, residual, w, b, 1e-5)
    assert torch.equal(h, x + residual)
    close(normed, layer_norm_reference(x + residual, w, b, 1e-5), dtype)
    u, attn = randn(R, H, D, dtype=dtype, g=g), randn(R, H, D, dtype=dtype, g=g)
    want = u.reshape(R, -1).float() * layer_norm_reference((attn * 0.5).reshape(R, -1), w, b, 1e-5).float()
    close(fused.gated_norm(u, attn, w, b, 1e-5, 0.5), want, dtype)
    q, k, v = (randn(R, H, D, dtype=dtype, g=g) for _ in range(3))
    score = (q.float() * k.float()).sum(-1) * 0.25
    close(fused.own_attention(q, k, v, 0.25), (score * torch.sigmoid(score))[..., None] * v.float(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_column_logprobs_are_the_log_softmax_at_those_columns(dtype, g):
    logits = randn(6, 1000, dtype=dtype, g=g) * 8  # peaked rows: the log-sum-exp must not overflow
    columns = torch.randint(0, 1000, (6, 13), generator=g)
    got = fused.column_logprobs(logits, columns)
    assert got.dtype == torch.float32 and got.shape == (6, 13)
    want = torch.log_softmax(logits.double(), dim=-1).gather(1, columns)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_compiled_column_logprobs_allocates_nothing_as_wide_as_the_vocabulary(g):
    """What the CUDA fast path relies on, read from Inductor's generated code (its CPU backend here): the row max and
    sum and the gathered columns are its only buffers; the [rows, vocab] log-softmax is never written."""
    import re

    from torch._inductor.utils import run_and_get_code

    logits, columns = randn(6, 1000, dtype=torch.bfloat16, g=g), torch.randint(0, 1000, (6, 13), generator=g)
    compiled = torch.compile(fused.column_logprobs, fullgraph=True)
    out, codes = run_and_get_code(compiled, logits, columns)
    torch.testing.assert_close(out, fused.column_logprobs(logits, columns))
    buffers = [shape for code in codes for shape in re.findall(r"empty_strided_\w+\(\(([^)]*)\)", code)]
    assert buffers and sorted(buffers) == ["6, 1", "6, 1", "6, 13"]


def test_selection_keys_sort_each_request_best_first(g):
    """One sort of the keys is every request's top-k: against a plain per-request sort of its candidates, on random
    scores with disallowed children (-inf), free pad steps, signed zeros, exact ties, positive and negative scores."""
    rows_per_req, C = [3, 1, 5, 2], 7
    R = sum(rows_per_req)
    segment = torch.repeat_interleave(torch.arange(len(rows_per_req)), torch.tensor(rows_per_req))
    scores = torch.randn(R, generator=g) * 50
    gains = torch.randn(R, C, generator=g) * 3
    scores[0], gains[0, :3] = -0.0, torch.tensor([0.0, -0.0, 0.0])  # +0 and -0, tied: either order is right
    allowed = torch.rand(R, C, generator=g) > 0.3
    free = torch.rand(R, C, generator=g) > 0.8
    allowed[0, :3], free[0, :3] = True, False  # the signed zeros stay as they are
    cand, keys = fused.selection_keys(scores, gains, allowed, free, segment)
    want_cand = torch.where(allowed, scores[:, None] + torch.where(free, 0.0, gains), -torch.inf)
    assert torch.equal(cand, want_cand) and cand[0, 1].item() == 0 and torch.signbit(cand[0, :3]).tolist() == [0, 1, 0]
    order = keys.flatten().sort(stable=True).indices
    start = 0
    for r, rows in enumerate(rows_per_req):
        mine = order[start * C : (start + rows) * C]  # request r's segment: its rows' candidates, best first
        assert ((mine // C >= start) & (mine // C < start + rows)).all(), r
        want = sorted(cand[start : start + rows].flatten().tolist(), reverse=True)
        assert cand.flatten()[mine].tolist() == want, r
        start += rows


def test_merge_spans_compiles_whole_and_merges_as_eager(g):
    """What a multi-span decode pass runs on CUDA with the fast path: `merge_spans` compiled (fullgraph, as
    `fused.pieces` compiles it; Inductor's CPU backend here) against the plain function, with rows that have keys in
    some spans only and a row with none (0 and -inf), at two row counts (the second makes the rows dynamic)."""
    from genrec.attention.merge import merge_spans

    compiled = torch.compile(merge_spans, fullgraph=True, dynamic=None)
    for M in (6, 10):
        spans, H, D = 4, 3, 8
        out = torch.randn(spans * M, H, D, generator=g).to(torch.bfloat16)
        lse = torch.randn(H, spans * M, generator=g) * 4
        lse.view(H, spans, M)[:, 1:, 0] = -torch.inf  # row 0: keys in its first span only
        lse.view(H, spans, M)[:, :, 1] = -torch.inf  # row 1: no keys at all
        out.view(spans, M, H, D)[:, 1] = 0
        got, want = compiled(out, lse, spans), merge_spans(out, lse, spans)
        torch.testing.assert_close(got[0].float(), want[0].float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
        assert (got[0][1] == 0).all() and (got[1][:, 1] == -torch.inf).all()
    assert fused.PLAIN.merge_spans is merge_spans


@pytest.mark.parametrize("S,P", [(2, 0), (1, 0), (1, 2), (2, 1)])
def test_suffix_merge_equals_one_softmax_over_context_and_suffix(g, S, P):
    """The merged piece against one plain softmax over [context keys, suffix keys] per row; the first P suffix keys
    read where they lie (a pool at each row's own slots), the decode's one-token rows (S == 1) included."""
    R, H, KV, D, C = 6, 4, 2, 8, 5
    U = P + S
    q = torch.randn(R, S, H, D, generator=g)
    ck, cv = torch.randn(R, C, KV, D, generator=g), torch.randn(R, C, KV, D, generator=g)
    sk, sv = torch.randn(R, U, KV, D, generator=g), torch.randn(R, U, KV, D, generator=g)
    mask = (torch.rand(R, S, U, generator=g) > 0.4) | (torch.arange(U) == U - 1)
    qh = q.transpose(1, 2)  # [R, H, S, D]
    ck_h, cv_h = (t.repeat_interleave(H // KV, dim=2).transpose(1, 2) for t in (ck, cv))  # [R, H, C, D]
    sk_h, sv_h = (t.repeat_interleave(H // KV, dim=2).transpose(1, 2) for t in (sk, sv))
    ctx_scores = qh @ ck_h.transpose(-1, -2) * 0.3
    out_ctx = (ctx_scores.softmax(-1) @ cv_h).transpose(1, 2).reshape(R * S, H, D)
    lse_ctx = torch.logsumexp(ctx_scores, -1).permute(1, 0, 2).reshape(H, R * S)
    past = (None, None, None)
    if P:  # the past keys scattered in a pool, read at their slots; a key no query sees reads a NaN slot (padding)
        at = torch.randperm(3 * R * P, generator=g)[: R * P].view(R, P)
        pool_k, pool_v = torch.full((3 * R * P + 1, KV, D), torch.nan), torch.full((3 * R * P + 1, KV, D), torch.nan)
        pool_k[at], pool_v[at] = sk[:, :P], sv[:, :P]
        past = (pool_k, pool_v, torch.where(mask[:, :, :P].any(dim=1), at, 3 * R * P))
    got = fused.suffix_merge(q, sk[:, P:], sv[:, P:], *past, mask, out_ctx, lse_ctx, 0.3)
    scores = torch.cat([ctx_scores, (qh @ sk_h.transpose(-1, -2) * 0.3).masked_fill(~mask[:, None], -torch.inf)], -1)
    want = (scores.softmax(-1) @ torch.cat([cv_h, sv_h], 2)).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_cpu_plan_runs_the_plain_pieces_whatever_the_switch():
    from genrec.engine.plan import ExecutionPlan
    from genrec.model.ops import PLAIN_OPS

    for device, fast in (("cpu", True), ("cpu", None), ("cpu", False), ("cuda", False)):  # CUDA opted out: plain
        plan = ExecutionPlan.build(device, torch.bfloat16, fast)
        assert plan.ops == PLAIN_OPS and not plan.compiles and not plan.graphs and plan.capture is None, device


def test_a_fast_engine_on_the_cpu_never_compiles(tiny_dir, monkeypatch, rng):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile called on the CPU path")

    monkeypatch.setattr(torch, "compile", refuse)
    fused.compiled.cache_clear()
    engine = Engine.from_pretrained(tiny_dir, cuda_fast=True, scheduler=SchedulerConfig(prefix_cache_bytes=0))
    request = RetrieveRequest(prompt_token_ids=random_prompt(engine, 20, rng), beam_width=4)
    assert engine.retrieve([request])[0].items


def test_packed_prefill_into_one_pool_writes_each_context_where_it_lives(tiny_dir, rng):
    """The K/V write of a packed pass, one index copy per layer into a shared pool: each context's extent holds
    what a prefill of it alone writes, and the pool's other tokens are untouched."""
    model = ModelDir.open(tiny_dir).load_model()
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=rng) for n in (9, 14, 5)]
    pool = KVPool(model.config, 64, "cpu", torch.float32)
    pool.k.fill_(7.0)
    pool.reserve(3)  # the contexts start past the pool's first tokens
    contexts = [pool.context(len(p)) for p in prompts]
    model.prefill(model.embed(prompts[2][:2]), contexts[2])  # the third continues a chunked prefill
    model.prefill_packed(
        [
            (model.embed(prompts[0]), contexts[0]),
            (model.embed(prompts[1]), contexts[1]),
            (model.embed(prompts[2][2:]), contexts[2]),
        ]
    )
    for prompt, ctx in zip(prompts, contexts, strict=True):
        alone = ContextKV.allocate(model.config, len(prompt), "cpu", torch.float32)
        model.prefill(model.embed(prompt), alone)
        torch.testing.assert_close(ctx.k, alone.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ctx.v, alone.v, rtol=1e-5, atol=1e-5)
    assert (pool.k[:, :3] == 7.0).all() and (pool.k[:, 3 + 28 :] == 7.0).all()


# What a layer runs on the CPU (bench kernels' figures; the tiny test model, 4 requests of beam 30), the ops inside
# the attention's custom op included. At b8456a4 (this counter): prefill 22 ops, decode 52 (float32) / 58 (bfloat16),
# the decode's ops outside the pieces 4 products and 2 concatenations (the past K/V), kernels if fused 11 / 14. The
# decode's suffix then read its past K/V where they lie and became products and sums (no matrix product inside the
# merge): 70 / 77 ops, most of them inside the merge piece, outside the pieces the 4 products only, kernels if fused
# 10. Lower a bound when a figure goes down.
OPS_PER_LAYER = {torch.float32: {"prefill": 22, "decode": 70}, torch.bfloat16: {"prefill": 22, "decode": 77}}
KERNELS_IF_FUSED = {"prefill": 11, "decode": 10}
# The design's floor outside the pieces: a decode layer copies, concatenates and fills nothing (its new K/V go in
# after the pass, one scatter for every layer); a prefill layer writes its K and V into the pool (2 index copies).
OUTSIDE = {
    "prefill": {"copy": 2, "cat": 0, "fill": 0, "other": 0},
    "decode": {"copy": 0, "cat": 0, "fill": 0, "other": 0},
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_ops_each_layer_runs_stay_within_their_bound(tiny_dir, dtype):
    """A change that adds ops to every layer (a cast, an unfused step, a copy between the pieces) fails here."""
    engine = Engine.from_pretrained(
        tiny_dir, dtype=dtype, scheduler=SchedulerConfig(prefix_cache_bytes=0), plan=kernels.marked_plan("cpu")
    )
    figures, _ = kernels.layer_counts(engine, 40, 4, 30)
    for name, figure in figures.items():
        assert figure["ops"] <= OPS_PER_LAYER[dtype][name], (name, figure)
        assert figure["kernels_if_fused"] <= KERNELS_IF_FUSED[name], (name, figure)
        assert all(figure["outside"][kind] <= n for kind, n in OUTSIDE[name].items()), (name, figure)
        assert figure["outside"]["matmul"] == 4, (name, figure)  # q/k/v, o, gate/up, down: the layer's products


def test_the_counter_sees_inside_custom_ops_and_tells_the_pieces_apart():
    """bench kernels' CPU counter: a genrec custom op's kernel is counted op by op, a marked piece's ops as its."""
    plan = kernels.marked_plan("cpu")
    q, k = torch.randn(6, 2, 4), torch.randn(10, 2, 4)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    args = (cu, torch.tensor([0, 0], dtype=torch.int32), torch.tensor([10], dtype=torch.int32))
    empty, gate_up, m = torch.zeros(6, dtype=torch.bool), torch.randn(3, 8), torch.randn(2, 2)
    with kernels.AtenOps() as counter:
        plan.ops.attention.static(q, k, k, *args, empty, 6, 10, 0.5)
        plan.ops.pieces.silu_mul(gate_up)
        torch.mm(m, m)
    tally = counter.tally
    assert tally.calls == {"attention": 1, "pieces": 1}
    assert tally.inside["attention"] > 1 and tally.inside["pieces"] == 2  # silu and mul; the chunk's views are free
    assert tally.outside == {"matmul": 1}


def test_the_ops_each_hstu_layer_runs_stay_within_their_bound(hstu_dir):
    model = ModelDir.open(hstu_dir).load_model()
    counts = kernels.hstu_layer_counts(model, 40, 8, PLAIN_OPS)
    assert kernels.ops_of(counts["hstu_prefill"]) <= 16 and kernels.ops_of(counts["hstu_candidates"]) <= 19, counts
