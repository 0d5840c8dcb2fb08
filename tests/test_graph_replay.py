"""A GPU hazard caught on the CPU: what a CUDA graph replays is its record, not the Python. A value the Python froze
at capture (a host tensor, a Python number, a buffer rebound after capture) stays frozen in every replay, and the
stand-in that reruns the Python each replay (tests.test_graph_capture.RecordedGraph) cannot see it. Here every pass
is traced once at the engine's start (tests.plans.TracedGraph: make_fx in real mode over the static buffers) and
replayed as that record over many steps whose requests, beam widths, levels, filters and catalog versions change:
the answers equal the eager engine's. A planted defect (a buffer rebound after capture) is caught here and missed by
the rerunning stand-in.
"""

import numpy as np
import pytest
import torch

from genrec.api import RetrieveRequest
from genrec.catalog import Catalog
from genrec.engine import Engine, SchedulerConfig
from genrec.engine.decode_batch import DecodeBatch
from tests.conftest import random_prompt
from tests.plans import TracedGraph, graphed_plan
from tests.test_graph_capture import RecordedGraph

pytestmark = pytest.mark.slow  # make test runs it; make test-fast skips it

# Small captures: passes of up to 32 rows of up to 4 requests, prefill passes of up to 16 tokens.
CONFIG = dict(prefix_cache_bytes=0, prefill_tokens_per_step=16, max_running=4)


def replaying(model_dir, graph_class, **plan_fields) -> Engine:
    plan = graphed_plan(graph_class, **plan_fields)
    engine = Engine.from_pretrained(model_dir, cuda_graph_max_rows=32, scheduler=SchedulerConfig(**CONFIG), plan=plan)
    assert engine.scheduler.idle  # its start: every pass traced once
    return engine


@pytest.fixture(scope="module")
def traced(tiny_dir):
    TracedGraph.made = []
    return replaying(tiny_dir, TracedGraph)


@pytest.fixture(scope="module")
def eager(tiny_dir):
    return Engine.from_pretrained(tiny_dir, scheduler=SchedulerConfig(**CONFIG))


def varied(engine: Engine, seed: int) -> list[list[RetrieveRequest]]:
    """Rounds of requests whose mix changes every step: widths, a widening schedule, an allow-list, exclusions."""
    g = torch.Generator().manual_seed(seed)
    items = engine.catalog.item_ids
    rounds = []
    for widths in ([7, 12, 3], [30, 1], [2, 5, 9, 16], [32]):
        asked = [
            RetrieveRequest(prompt_token_ids=random_prompt(engine, 5 + 7 * w % 29, g), beam_width=w) for w in widths
        ]
        asked[0] = asked[0].model_copy(update={"allowed_item_ids": list(items[::3])})
        if len(asked) > 1:
            asked[-1] = asked[-1].model_copy(update={"exclude_item_ids": list(items[:60:2])})
        if len(asked) > 2:
            asked[1] = asked[1].model_copy(update={"beam_width": None, "beam_widths": [2, 5, 11]})
        rounds.append(asked)
    return rounds


def same(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        assert [i.item_id for i in a.items] == [i.item_id for i in b.items]
        assert np.allclose([i.logprob for i in a.items], [i.logprob for i in b.items], atol=1e-5)


def test_replaying_the_record_equals_the_eager_engine_as_requests_filters_and_catalogs_change(
    traced, eager, tiny_dir, tmp_path
):
    made, before = len(TracedGraph.made), sum(g.replays for g in TracedGraph.made)
    for asked in varied(traced, 1):
        same(traced.retrieve(asked), eager.retrieve(asked))
    catalog = Catalog.load(tiny_dir / "genrec/catalog.parquet")  # a new catalog version, live: data, not a shape
    rows = np.arange(0, len(catalog), 2)
    path = tmp_path / "half.parquet"
    Catalog(catalog.item_ids[rows], catalog.codes[rows], catalog.lengths[rows]).save(path)
    for engine in (traced, eager):
        engine.load_catalog(path)
    for asked in varied(traced, 2):
        same(traced.retrieve(asked), eager.retrieve(asked))
    assert len(TracedGraph.made) == made and traced.runner.uncaptured_passes == 0  # only replays after the start
    assert sum(g.replays for g in TracedGraph.made) > before + 12
    for engine in (traced, eager):
        engine.rollback_catalog()  # the model's own catalog again, for the module's other tests


def test_passes_that_select_themselves_replay_as_the_eager_selection(tiny_dir, eager):
    selecting = replaying(tiny_dir, TracedGraph, selects_in_graph=True)
    for asked in varied(selecting, 3):
        same(selecting.retrieve(asked), eager.retrieve(asked))


class RebindingBatch(DecodeBatch):
    """The planted defect: a pass's token buffer rebound (a new tensor) before it is filled, after the capture."""

    def fill(self, selections):
        self.tokens = torch.zeros_like(self.tokens)
        return super().fill(selections)


def planted(engine: Engine) -> Engine:
    for batch, _ in engine.runner._captured.values():
        batch.__class__ = RebindingBatch
    return engine


def test_a_buffer_rebound_after_capture_is_caught_by_replaying_the_record(tiny_dir, eager):
    asked = varied(eager, 4)[0]
    TracedGraph.made = []
    wrong = planted(replaying(tiny_dir, TracedGraph)).retrieve(asked)
    want = eager.retrieve(asked)
    assert any([i.item_id for i in a.items] != [i.item_id for i in b.items] for a, b in zip(wrong, want, strict=True))
    RecordedGraph.made = []
    rerun = planted(replaying(tiny_dir, RecordedGraph)).retrieve(asked)  # the Python rerun reads the new buffer
    same(rerun, want)  # the old stand-in's blind spot


def test_a_replayed_prefill_writes_its_k_v_in_the_graph_at_its_own_slots_and_padding_only_to_scratch(traced, eager):
    """The prefill's stages write each layer's K/V inside the record, at slots the pass fills in before its first
    replay: a pass of 11 tokens in the 16-token bucket writes its 11 slots (equal to the eager prefill's K/V) and its
    5 padding rows the pool's scratch slot (outside its budget), no other slot of the pool."""
    graphs = traced.runner.prefill_graphs
    pool, scratch = graphs.pool, graphs.pool.scratch
    prompt = random_prompt(traced, 11, torch.Generator().manual_seed(5))
    want = eager.runner.prefill_alone(eager.prepare(RetrieveRequest(prompt_token_ids=prompt))).ctx
    bucket = graphs.graphs[16]
    replays = sum(g.replays for g in bucket)
    assert pool.used == 0 and pool._extents.largest == pool.tokens  # the captures took none of the KV budget
    pool.k.fill_(7.0)
    pool.v.fill_(7.0)
    ctx = pool.context(11)
    try:
        start = ctx.extent.start
        traced.runner.prefill([(traced.prepare(RetrieveRequest(prompt_token_ids=prompt)), ctx, 0, 11)])
        assert sum(g.replays for g in bucket) == replays + graphs.layers + 1  # every stage replayed, none eager
        assert torch.allclose(ctx.k, want.k, atol=1e-5) and torch.allclose(ctx.v, want.v, atol=1e-5)
        for kv in (pool.k, pool.v):
            written = (kv != 7.0).flatten(2).any(-1).any(0).nonzero().flatten().tolist()  # slots any layer wrote
            assert written == sorted([*range(start, start + 11), scratch])
    finally:
        ctx.release()


def test_a_prefill_alone_with_graphs_runs_in_the_engines_pool_and_gives_its_tokens_back(traced, eager):
    prompt = random_prompt(traced, 13, torch.Generator().manual_seed(6))
    want = eager.runner.prefill_alone(eager.prepare(RetrieveRequest(prompt_token_ids=prompt)))
    pool = traced.runner.prefill_graphs.pool
    used, bucket = pool.used, traced.runner.prefill_graphs.graphs[16]
    replays = sum(g.replays for g in bucket)
    got = traced.runner.prefill_alone(traced.prepare(RetrieveRequest(prompt_token_ids=prompt)))
    assert sum(g.replays for g in bucket) > replays and pool.used == used and got.ctx.pool is not pool
    assert torch.allclose(got.ctx.k, want.ctx.k, atol=1e-5) and torch.allclose(got.ctx.v, want.ctx.v, atol=1e-5)
    assert torch.allclose(got.last_logits, want.last_logits, atol=1e-4)
