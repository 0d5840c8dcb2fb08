"""The decode pass padded to a row bucket (the shape a CUDA graph replays), run eagerly on the CPU."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from genrec.api import RetrieveRequest
from genrec.engine.beam import fetch_finals
from genrec.engine.decode_batch import DecodeBatch
from genrec.engine.selection import choices
from genrec_bench import gpu_check
from tests.conftest import random_prompt


def pooled_cohorts(engine, rng, shape):
    """Cohorts as the scheduler makes them: contexts and BeamKV slots in one pool. shape: (prompt, width) each."""
    pool = engine.runner.new_pool(4096)
    prepared = [
        engine.prepare(RetrieveRequest(prompt_token_ids=random_prompt(engine, n, rng), beam_width=w)) for n, w in shape
    ]
    return pool, gpu_check.pooled_cohorts(engine, prepared, pool)


def test_bucketed_passes_equal_passes_sized_to_the_rows(arch_engine, rng):
    engine = arch_engine  # each decoder architecture's
    shape = [(23, 5), (40, 9), (11, 30)]
    state = rng.get_state()
    pool, static = pooled_cohorts(engine, rng, shape)
    rng.set_state(state)
    _, eager = pooled_cohorts(engine, rng, shape)
    runner = engine.runner
    runner.decode(static[:1], bucketed=True)  # one runs ahead: a pass mixes levels and suffix lengths
    runner.decode(eager[:1], bucketed=False)
    while not all(c.done for c in static):
        runner.decode([c for c in static if not c.done], bucketed=True)
        runner.decode([c for c in eager if not c.done], bucketed=False)
    for (s_scores, s_items), (e_scores, e_items) in zip(fetch_finals(static), fetch_finals(eager), strict=True):
        assert s_items == e_items and np.allclose(s_scores, e_scores, atol=1e-5)


class OpShapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        self.ops.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


def decode_batch(engine, pool, bucket):
    """A pass's inputs as a captured graph holds them: as many columns as any node's children may be."""
    past = max(engine.catalog.levels - 2, 0)
    return DecodeBatch(bucket, past, pool, engine.plan.ops, columns=engine.family.max_children)


def recorded_pass(engine, pool, cohorts, bucket):
    buf = decode_batch(engine, pool, bucket)
    rows = buf.fill(choices(cohorts))
    with OpShapes() as rec:
        gains, _, _ = engine.runner.decode_forward(buf)
    return rec.ops, gains, rows, buf


def test_two_request_mixes_in_one_bucket_run_the_same_op_shapes(engine, rng):
    _, one = pooled_cohorts(engine, rng, [(50, 13)])
    pool, three = pooled_cohorts(engine, rng, [(9, 3), (31, 4), (12, 2)])
    engine.runner.decode(three[:1], bucketed=True)  # mixed levels
    first, _, rows_a, _ = recorded_pass(engine, one[0].slot_pool, one, 32)
    second, _, rows_b, _ = recorded_pass(engine, pool, three, 32)
    assert rows_a != rows_b and first == second  # a different mix, the same ops on the same shapes: replayable


def test_a_pass_writes_every_cohorts_new_kv_with_one_scatter_into_their_own_slots_and_padding_to_scratch(engine, rng):
    pool, cohorts = pooled_cohorts(engine, rng, [(9, 3), (31, 4), (12, 2)])
    engine.runner.decode(cohorts[:1], bucketed=True)  # mixed levels: the cohorts' slots of different passes
    _, _, rows, buf = recorded_pass(engine, pool, cohorts, 64)
    new_k, new_v = torch.randn(2, *pool.k.shape[:1], 64, 1, *pool.k.shape[2:])
    before_k = pool.k.clone()
    with OpShapes() as rec:
        buf.write_kv(new_k, new_v)  # the whole bucket: what a captured pass writes inside its graph
    assert [op for op, _ in rec.ops if "copy" in op or "index_put" in op or "scatter" in op] == [
        "aten.index_copy_.default"
    ] * 2
    row, written = 0, []
    for c in cohorts:  # a cohort's rows of pass `level` own its BeamKV slots base[level - 1] on, in order
        at = c.slot_offset + c.base[c.level - 1] + torch.arange(c.rows)
        assert torch.equal(pool.k[:, at], new_k[:, row : row + c.rows, 0])
        assert torch.equal(pool.v[:, at], new_v[:, row : row + c.rows, 0])
        row, written = row + c.rows, written + at.tolist()
    assert row == rows < 64  # padding rows: their K/V went to the scratch slot alone
    same = (pool.k == before_k) | (pool.k.isnan() & before_k.isnan())  # the pool is uninitialised: NaN != NaN
    changed = (~same).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
    assert changed == sorted([*written, pool.scratch])


def test_padding_a_bucket_never_changes_real_rows(engine, rng):
    pool, cohorts = pooled_cohorts(engine, rng, [(20, 6), (33, 7)])
    engine.runner.decode(cohorts, bucketed=True)
    _, tight, rows, _ = recorded_pass(engine, pool, cohorts, 16)
    buf = decode_batch(engine, pool, 64)
    assert buf.fill(choices(cohorts)) == rows
    buf.tokens[rows:] = torch.randint(0, engine.model.config.vocab_size, (64 - rows,))  # junk in the padding
    buf.positions[rows:] = 7
    wide, _, _ = engine.runner.decode_forward(buf)
    assert (wide[:rows] - tight[:rows]).abs().max().item() <= 1e-5
    assert torch.isfinite(wide).all()


def test_a_bucketed_pass_runs_without_a_sync(engine, rng):
    from tests.sync_guard import no_sync

    pool, cohorts = pooled_cohorts(engine, rng, [(20, 6), (33, 7)])
    with no_sync():
        while not all(c.done for c in cohorts):
            engine.runner.decode(cohorts, bucketed=True)
    assert all(len(items) == c.rows for (_, items), c in zip(fetch_finals(cohorts), cohorts, strict=True))


def test_contexts_with_reused_prefix_pieces_decode_the_same_bucketed_and_sized_to_the_rows(engine, rng):
    """Contexts of 1, 2 and 3 spans in one pass (prefix pieces of an earlier prompt, read in place)."""
    from genrec.engine.beam import fetch_finals, slots_needed, start_cohort
    from genrec.model.kv_pool import ContextKV, Piece

    def cohorts(pool):
        base = random_prompt(engine, 48, torch.Generator().manual_seed(3))
        first = engine.prepare(RetrieveRequest(prompt_token_ids=base, beam_width=4))
        shared = pool.context(48)
        engine.runner.prefill([(first, shared, 0, 48)])
        out = []
        for pieces, extra in (([], 10), ([(0, 32)], 7), ([(0, 16), (16, 32)], 20)):
            tokens = base[: sum(n for _, n in pieces)] + random_prompt(
                engine, extra, torch.Generator().manual_seed(extra)
            )
            p = engine.prepare(RetrieveRequest(prompt_token_ids=tokens, beam_width=5))
            prefix = [Piece(shared.extent.retain(), shared.extent.start + a, n) for a, n in pieces]
            ctx = ContextKV(pool.reserve(len(tokens) - sum(n for _, n in pieces)), prefix)
            logits = engine.runner.prefill([(p, ctx, ctx.prefix_length, len(tokens) - ctx.prefix_length)])
            slots = pool.reserve(slots_needed(engine.family.trie, [5]))
            out.append(start_cohort(engine.family.trie, [p], [ctx], logits, slots=slots))
        return out

    bucketed, exact = cohorts(engine.runner.new_pool(2048)), cohorts(engine.runner.new_pool(2048))
    assert [len(c.contexts[0].spans()) for c in exact] == [1, 2, 3]
    while not all(c.done for c in exact):
        engine.runner.decode(bucketed, bucketed=True)
        engine.runner.decode(exact, bucketed=False)
    for (b_scores, b_items), (e_scores, e_items) in zip(fetch_finals(bucketed), fetch_finals(exact), strict=True):
        assert b_items == e_items and np.allclose(b_scores, e_scores, atol=1e-5)


def test_a_node_with_more_children_than_the_batch_holds_is_refused_by_name(engine, rng):
    pool, cohorts = pooled_cohorts(engine, rng, [(20, 6)])
    (selection,) = choices(cohorts)
    past = max(engine.catalog.levels - 2, 0)
    narrow = DecodeBatch(16, past, pool, engine.plan.ops, columns=selection.columns - 1)
    with pytest.raises(ValueError, match=f"a node has {selection.columns} children; this batch holds"):
        narrow.fill([selection])


def test_split_spans_halves_the_longest_while_its_halves_hold_the_shortest_chunk():
    from genrec.engine.decode_batch import split_spans

    assert split_spans([(100, 5000)], 4, 512) == [(100, 1250), (1350, 1250), (2600, 1250), (3850, 1250)]
    assert split_spans([(0, 1000)], 4, 512) == [(0, 1000)]  # halves of 500: too short to pay
    assert split_spans([(0, 64), (500, 2048)], 4, 512) == [(0, 64), (500, 512), (1012, 512), (1524, 1024)]
    assert split_spans([(0, 4096)], 1, 512) == [(0, 4096)]  # a one-span batch holds no more


def test_split_kv_auto_splits_a_pass_that_leaves_most_sms_idle_at_any_context():
    from genrec.engine.plan import ExecutionPlan
    from tests.plans import CUDA_OPS_ON_CPU

    heads = 16  # Qwen3-1.7B on an H200 (132 SMs)
    plan = ExecutionPlan(torch.device("cpu"), CUDA_OPS_ON_CPU, sms=132)
    assert plan.splits([256], 5000, heads)  # 2 query blocks x 16 heads: 32 of 132 SMs busy; split, 128
    assert plan.splits([256], 1000, heads)  # a short context too: 4 chunks of 250 tokens
    assert plan.splits([256, 256], 1000, heads)  # 64 blocks: 256 split, within two waves
    assert not plan.splits([256] * 4, 5000, heads)  # 128 blocks: 512 split, four waves
    assert not plan.splits([256] * 8, 5000, heads)  # 256 thread blocks fill the GPU as they are
    assert not plan.splits([256], 255, heads)  # too short to cut
    assert not ExecutionPlan(torch.device("cpu"), CUDA_OPS_ON_CPU).splits([256], 5000, heads)  # no SMs known
    off, on = (ExecutionPlan(torch.device("cpu"), CUDA_OPS_ON_CPU, split_kv=s, sms=132) for s in ("off", "on"))
    assert not off.splits([256], 5000, heads) and on.splits([256] * 8, 5000, heads)


def test_a_long_context_split_over_the_spare_blocks_decodes_as_read_whole(tiny_dir, engine, rng):
    """Split-KV: one-span contexts of 1,300 and 2,100 tokens cut into chunks (the plan's `split_kv` on, as a GPU with
    SMs to fill would) give the same beams and scores as each read whole."""
    from genrec.engine import Engine
    from genrec.engine.plan import ExecutionPlan
    from genrec.model.kv_pool import MAX_SPANS
    from tests.plans import CUDA_OPS_ON_CPU

    splitting = Engine.from_pretrained(
        tiny_dir, plan=ExecutionPlan(torch.device("cpu"), CUDA_OPS_ON_CPU, split_kv="on")
    )
    shape = [(1300, 6), (2100, 4)]
    state = rng.get_state()
    _, split = pooled_cohorts(splitting, rng, shape)
    rng.set_state(state)
    _, whole = pooled_cohorts(engine, rng, shape)
    runner = splitting.runner
    while not all(c.done for c in split):
        runner.decode(split, bucketed=True)
    assert any(key[2] == MAX_SPANS for key in runner._buckets)  # the passes ran in the multi-span bucket
    while not all(c.done for c in whole):
        engine.runner.decode(whole, bucketed=False)
    for (s_scores, s_items), (w_scores, w_items) in zip(fetch_finals(split), fetch_finals(whole), strict=True):
        assert s_items == w_items and np.allclose(s_scores, w_scores, atol=1e-5)


def test_a_pass_merges_its_spans_with_its_own_pieces(engine):
    """The context's span merge is the pass's piece: compiled where the plan's pieces are (CUDA), plain otherwise."""
    import dataclasses

    from genrec.model import fused
    from genrec.model.ops import PLAIN_OPS, ModelOps

    compiled = dataclasses.replace(fused.PLAIN, merge_spans=lambda out, lse, spans: (out, lse))
    pool = engine.runner.new_pool(64)
    assert DecodeBatch(16, 1, pool, ModelOps(compiled), 4).context.merge is compiled.merge_spans
    assert DecodeBatch(16, 1, pool, PLAIN_OPS, 4).context.merge is fused.PLAIN.merge_spans
