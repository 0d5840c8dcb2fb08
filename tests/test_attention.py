"""Shared-context attention against one plain softmax over [context ; suffix] per row."""

import pytest
import torch

from genrec.attention import shared_context_attention, varlen
from tests.reference import GroupedContext, LayerContext


def reference(q, groups, suf_k, suf_v, mask, scale):
    R, S, H, D = q.shape
    KV = suf_k.shape[2]
    out = torch.empty_like(q)
    ctx_of = {}
    for g in groups:
        for r in range(g.start, g.stop):
            ctx_of[r] = g
    for r in range(R):
        keys, values = suf_k[r], suf_v[r]  # [U, KV, D]
        visible = mask[min(r, len(mask) - 1)] if mask is not None else torch.ones(S, keys.shape[0], dtype=torch.bool)
        if r in ctx_of:
            g = ctx_of[r]
            keys = torch.cat([g.k.transpose(0, 1), keys])
            values = torch.cat([g.v.transpose(0, 1), values])
            visible = torch.cat([torch.ones(S, g.k.shape[1], dtype=torch.bool), visible], dim=1)
        k = keys.repeat_interleave(H // KV, dim=1).transpose(0, 1)  # [H, T, D]
        v = values.repeat_interleave(H // KV, dim=1).transpose(0, 1)
        s = (q[r].transpose(0, 1) @ k.transpose(1, 2)) * scale  # [H, S, T]
        s = s.masked_fill(~visible[None], float("-inf"))
        out[r] = (torch.softmax(s, -1) @ v).transpose(0, 1)
    return out


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("S,U,causal", [(1, 3, False), (4, 4, True), (3, 5, True)])
def test_matches_plain_softmax(monkeypatch, fused, S, U, causal):
    if not fused:
        monkeypatch.setattr(varlen, "_fused_kernel", lambda q: None)
    g = torch.Generator().manual_seed(S * 10 + U)
    R, H, KV, D = 7, 6, 2, 8
    q = torch.randn(R, S, H, D, generator=g)
    suf_k, suf_v = torch.randn(R, U, KV, D, generator=g), torch.randn(R, U, KV, D, generator=g)
    groups = [
        LayerContext(0, 3, torch.randn(KV, 11, D, generator=g), torch.randn(KV, 11, D, generator=g)),
        LayerContext(3, 6, torch.randn(KV, 29, D, generator=g), torch.randn(KV, 29, D, generator=g)),
    ]  # row 6 has no context: suffix only
    mask = None
    if causal:
        u = torch.arange(U)
        mask = (u[None, :] <= torch.arange(S)[:, None] + (U - S))[None]
    got = shared_context_attention(q, GroupedContext(groups, S), suf_k, suf_v, mask, 0.3)
    want = reference(q, groups, suf_k, suf_v, mask, 0.3)
    assert (got - want).abs().max().item() < 1e-5


def zero_row_groups() -> None:
    """A group of no rows (a request with nothing left to score) among others, fused kernel on."""
    from genrec.attention import ContextGroup, ContextRows
    from tests.reference import layer_groups
    from tests.test_varlen import contexts, pool_of

    g = torch.Generator().manual_seed(5)
    pool = pool_of(64, 5)
    a, b = contexts(pool, [9, 9])
    R, S, U = 3, 1, 2
    KV, D = pool.k.shape[2], pool.k.shape[3]
    q = torch.randn(R, S, KV * 3, D, generator=g)
    suf_k, suf_v = torch.randn(R, U, KV, D, generator=g), torch.randn(R, U, KV, D, generator=g)
    full = [ContextGroup(0, 0, a), ContextGroup(0, 3, b)]
    got = shared_context_attention(q, ContextRows(full, R).at_layer(0), suf_k, suf_v, None, 0.3)
    assert (got - reference(q, layer_groups(full[1:], 0), suf_k, suf_v, None, 0.3)).abs().max().item() < 1e-5
    out, lse = varlen.context_attention(q.new_empty(KV, 0, D), *a.layer(0), 0.3)
    assert out.shape == (KV, 0, D) and lse.shape == (KV, 0)
    print("ok")


def test_zero_row_groups_never_reach_a_kernel():
    from tests.test_engine_robustness import run_isolated

    assert run_isolated("tests.test_attention:zero_row_groups").strip() == "ok"


@pytest.mark.parametrize("spans", [1, 2, 3, 4])
def test_one_call_over_every_span_matches_one_softmax_over_the_spans_keys(spans):
    """The static decode pass's context part (one varlen call per layer, the rows repeated per span, one exact
    merge) against a plain softmax over each row's spans concatenated; a request with fewer spans, one with none."""
    from types import SimpleNamespace

    from genrec.model.kv_pool import KVPool

    g = torch.Generator().manual_seed(spans)
    H, KV, D, B = 4, 2, 8, 16
    shape = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=KV, head_dim=D)
    pool = KVPool(shape, 256, "cpu", torch.float32)
    pool.k.normal_(generator=g), pool.v.normal_(generator=g)
    # Requests of 3, 5 and 2 rows (then padding): the first has every span, the second one, the third none.
    counts = [3, 5, 2]
    layout = [[(10 * j, 7 + j) for j in range(spans)], [(200, 9)], []]
    q = torch.randn(B, H, D, generator=g)
    ctx = _static_context(pool, B, spans, counts, layout)
    out, lse = ctx.at_layer(0).attend(q, 0.3)
    row = 0
    for count, parts in zip(counts, layout, strict=True):
        for r in range(row, row + count):
            if not parts:
                assert (out[r] == 0).all() and (lse[:, r] == float("-inf")).all()
                continue
            keys = torch.cat([pool.k[0, a : a + n] for a, n in parts]).repeat_interleave(H // KV, 1)
            values = torch.cat([pool.v[0, a : a + n] for a, n in parts]).repeat_interleave(H // KV, 1)
            s = torch.einsum("hd,thd->ht", q[r], keys) * 0.3
            want = torch.einsum("ht,thd->hd", torch.softmax(s, -1), values)
            assert torch.allclose(out[r], want, atol=1e-5) and torch.allclose(lse[:, r], s.logsumexp(-1), atol=1e-5)
        row += count
    assert (out[row:] == 0).all()  # padding rows read no context


def _static_context(pool, bucket, spans, counts, layout):
    """A StaticContext as `DecodeBatch` fills it (the same tables, through its own code)."""
    from genrec.engine.decode_batch import DecodeBatch
    from genrec.model.ops import PLAIN_OPS

    batch = DecodeBatch(bucket, 0, pool, PLAIN_OPS, spans)
    tables = batch._span_tables(layout, counts, bucket - sum(counts))
    for buffer, host, dtype in tables:
        buffer.copy_(torch.as_tensor(host).to(dtype))
    return batch.context


def test_the_suffix_scores_are_float32_products_in_a_half_precision_pass():
    """The suffix part's scores are computed from float32 operands (the context part's kernel keeps its scores in
    float32): a bfloat16 product would round each score before the softmax, an error of ~2^-8 of its size."""
    from genrec.attention.merge import suffix_merge

    g = torch.Generator().manual_seed(5)
    R, S, U, KV, G, D = 3, 1, 4, 2, 2, 64
    q = (torch.randn(R, S, KV * G, D, generator=g) * 4).bfloat16()
    k, v = (torch.randn(R, U, KV, D, generator=g) * 4).bfloat16(), torch.randn(R, U, KV, D, generator=g).bfloat16()
    no_context = (torch.zeros(R * S, KV * G, D).bfloat16(), torch.full((KV * G, R * S), float("-inf")))
    got = suffix_merge(q, k, v, None, None, None, None, *no_context, 0.125).float()
    qf, kf = q.float().view(R, S, KV, G, D), k.float()
    p = torch.softmax(torch.einsum("rskgd,rukd->rkgsu", qf, kf) * 0.125, -1)
    want = torch.einsum("rkgsu,rukd->rskgd", p, v.float()).reshape(R, S, KV * G, D)
    rounded = torch.einsum("rskgd,rukd->rkgsu", q.view(R, S, KV, G, D), k).float() * 0.125
    coarse = torch.einsum("rkgsu,rukd->rskgd", torch.softmax(rounded, -1), v.float()).reshape(R, S, KV * G, D)
    assert (got - want).abs().max() < (coarse - want).abs().max() / 2  # closer than the bf16 product's answer
