"""One varlen context-attention call per layer: equal to the per-group attention it replaces (float32)."""

import pytest
import torch

from genrec.attention import (
    ContextGroup,
    ContextRows,
    Spans,
    shared_context_attention,
    varlen_reference,
)
from genrec.model.config import Qwen3Config
from genrec.model.kv_pool import KVPool
from tests.reference import GroupedContext, layer_groups

KV, G, D = 2, 3, 8


def pool_of(tokens: int, seed: int) -> KVPool:
    config = Qwen3Config(
        vocab_size=8,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=2,
        num_key_value_heads=KV,
        num_attention_heads=KV * G,
        head_dim=D,
    )
    pool = KVPool(config, tokens, "cpu", torch.float32)
    g = torch.Generator().manual_seed(seed)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    return pool


def contexts(pool: KVPool, lengths: list[int], gap: int = 3):
    out = []
    for n in lengths:
        pool.context(gap)  # contexts sit at offsets with gaps between them
        ctx = pool.context(n)
        ctx.length = n
        out.append(ctx)
    return out


@pytest.mark.parametrize("S,causal", [(1, False), (3, True)])
def test_pooled_rows_equal_per_group_attention(S, causal):
    pool, other = pool_of(200, 1), pool_of(40, 2)
    a, b, c = contexts(pool, [11, 29, 0])
    (d,) = contexts(other, [7])  # a second pool: one more call, merged exactly
    groups = [
        ContextGroup(0, 3, a),
        ContextGroup(4, 4, b),
        ContextGroup(4, 6, b),
        ContextGroup(7, 8, c),
        ContextGroup(8, 10, d),
    ]  # row 3 and 10 have no context; a zero-row group; an empty context
    R, U = 11, 4
    g = torch.Generator().manual_seed(S)
    q = torch.randn(R, S, KV * G, D, generator=g)
    suf_k, suf_v = torch.randn(R, U, KV, D, generator=g), torch.randn(R, U, KV, D, generator=g)
    mask = None
    if causal:
        mask = (torch.arange(U)[None, :] <= torch.arange(S)[:, None] + (U - S))[None]
    rows = ContextRows(groups, R, S)
    for layer in range(2):
        want = shared_context_attention(q, GroupedContext(layer_groups(groups, layer), S), suf_k, suf_v, mask, 0.3)
        got = shared_context_attention(q, rows.at_layer(layer), suf_k, suf_v, mask, 0.3)
        assert (got - want).abs().max().item() <= 1e-5


def plain(q, keys, values, scale, causal):
    """One sequence by definition: softmax over [H, m, n] scores, bottom-right causal."""
    H, KVh = q.shape[1], keys.shape[1]
    k = keys.repeat_interleave(H // KVh, 1).transpose(0, 1)
    v = values.repeat_interleave(H // KVh, 1).transpose(0, 1)
    s = q.transpose(0, 1) @ k.transpose(1, 2) * scale
    m, n = q.shape[0], keys.shape[0]
    if causal:
        s = s.masked_fill(torch.arange(n)[None, :] > torch.arange(n - m, n)[:, None], float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(0, 1), torch.logsumexp(s, -1)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_reference_is_softmax_per_sequence_with_its_lse(causal):
    pool = pool_of(100, 3)
    g = torch.Generator().manual_seed(4)
    cu_q, starts, lengths = [0, 4, 4, 9, 11], [50, 7, 0, 20], [6, 9, 5, 0]  # a sequence of no queries; no keys
    q = torch.randn(cu_q[-1], KV * G, D, generator=g)
    spans = Spans(cu_q, starts, lengths)
    out, lse = varlen_reference(q, pool.k[1], pool.v[1], spans, 0.4, causal=causal)
    for b in range(4):
        lo, hi, s, n = cu_q[b], cu_q[b + 1], starts[b], lengths[b]
        if hi == lo:
            continue
        if n == 0:
            assert (out[lo:hi] == 0).all() and (lse[:, lo:hi] == float("-inf")).all()
            continue
        want, want_lse = plain(q[lo:hi], pool.k[1, s : s + n], pool.v[1, s : s + n], 0.4, causal)
        assert (out[lo:hi] - want).abs().max().item() <= 1e-5
        assert (lse[:, lo:hi] - want_lse).abs().max().item() <= 1e-5
    no_lse, none = varlen_reference(q, pool.k[1], pool.v[1], spans, 0.4, causal=causal, need_lse=False)
    assert none is None and (no_lse - out).abs().max().item() <= 1e-5


def test_the_gpu_check_runs_its_engine_part_on_cpu_where_the_switch_changes_nothing(arch_dir, arch_engine):
    """The prepared GPU script's pieces import and run here (on the CPU the fast switch falls back): the fast engine
    judged against float32 (itself, here) is exact."""
    from genrec.api import RetrieveRequest
    from genrec.engine import Engine, SchedulerConfig
    from genrec_bench import gpu_check

    assert gpu_check.versions()["schema_has_seqused_k"]
    fast = Engine.from_pretrained(arch_dir, cuda_fast=True, scheduler=SchedulerConfig(prefix_cache_bytes=0))
    request = RetrieveRequest(prompt_token_ids=list(range(5, 65)), beam_width=40)
    got = gpu_check.judged({"fast": fast}, arch_engine, request)
    assert got["ok"] and got["fast"]["max_logprob_error"] < 1e-4 and got["fast"]["overlap_with_float32"] == 1.0
