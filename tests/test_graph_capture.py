"""CUDA graph capture happens at engine start only, and every live decode pass replays a captured one.

On the CPU-only CI the runner's capture is replaced by a recorder: "capturing" runs the pass once under a dispatch
mode that records every op and its shapes; a "replay" reruns the pass on the buffers' current contents and fails
unless it runs the very same ops on the very same shapes (what replaying a real graph assumes). Everything else is
the engine's own path: the scheduler, the bucketed batches, the one-call context attention, the selection.
"""

import dataclasses

import numpy as np
import pytest
import torch

from genrec.api import RetrieveRequest
from genrec.engine import Engine, SchedulerConfig
from tests.conftest import random_prompt
from tests.plans import graphed_plan
from tests.sync_guard import no_sync
from tests.test_decode_graph import OpShapes  # the op-and-shape recorder the graph tests share


class RecordedGraph:
    """A CPU stand-in for `torch.cuda.CUDAGraph` around one decode pass (see the module's docstring)."""

    made: list = []

    def __init__(self, forward):
        self.forward = forward
        with OpShapes() as rec:
            self.outputs = forward()
        self.ops, self.replays = rec.ops, 0
        RecordedGraph.made.append(self)

    def replay(self) -> None:
        with OpShapes() as rec:
            outputs = self.forward()
        assert rec.ops == self.ops, "a live pass ran other ops or shapes than the captured one"
        for captured, now in zip(self.outputs or (), outputs or (), strict=True):
            captured.copy_(now)  # a graph's outputs live in fixed memory (a prefill stage writes its buffers)
        self.replays += 1


@pytest.fixture
def graphed(tiny_dir):
    """An engine whose runner 'captures' as a graph engine on CUDA does: decode buckets of 16 and 32 rows (a pass holds
    <= 32 rows), prefill stages for 16, 32 and 64 tokens (a prefill pass holds <= 64 tokens)."""
    RecordedGraph.made = []
    config = SchedulerConfig(prefix_cache_bytes=0, prefill_tokens_per_step=64)
    return Engine.from_pretrained(tiny_dir, cuda_graph_max_rows=32, scheduler=config, plan=graphed_plan(RecordedGraph))


def retrieves(engine, rng, widths):
    return [
        RetrieveRequest(prompt_token_ids=random_prompt(engine, 20 + 3 * i, rng), beam_width=w)
        for i, w in enumerate(widths)
    ]


def test_every_bucket_is_captured_at_start_and_live_passes_only_replay(graphed, engine, rng):
    assert graphed.scheduler.idle  # the engine starts: its scheduler, its pool, its captures
    captured = list(RecordedGraph.made)
    stages = graphed.model.config.num_hidden_layers + 1
    # Decode: buckets 32 and 16, each for one-span and multi-span contexts; prefill: 3 token buckets of every stage.
    runner = graphed.runner
    # Decode: buckets 32 and 16, each for one-span and multi-span contexts, at each sequence capacity its rows may
    # need; prefill: 3 token buckets of every stage.
    passes = decode_passes(runner)
    assert len(captured) == passes + 3 * stages and len(runner._captured) == passes
    assert runner.warmup_s is not None and runner.graph_max_rows == 32
    state = rng.get_state()
    requests = retrieves(graphed, rng, [7, 12, 30, 5])  # 54 rows at full width: more than one pass holds
    with no_sync():
        got = graphed.retrieve(requests)
    rng.set_state(state)
    want = engine.retrieve(retrieves(engine, rng, [7, 12, 30, 5]))  # the session's eager engine
    assert RecordedGraph.made == captured  # nothing captured on a live request
    assert graphed.runner.uncaptured_passes == 0
    decode, prefill = captured[:passes], captured[passes:]
    assert sum(g.replays for g in decode) >= 3 and sum(g.replays for g in prefill) >= 2 * stages  # 4 prompts, 2 passes
    for a, b in zip(got, want, strict=True):
        assert [i.item_id for i in a.items] == [i.item_id for i in b.items]
        assert np.allclose([i.logprob for i in a.items], [i.logprob for i in b.items], atol=1e-4)


def decode_passes(runner) -> int:
    """The decode passes an engine captures: per bucket, one and MAX_SPANS spans at each of its capacities."""
    buckets = [
        runner.graph_max_rows >> i
        for i in range(runner.graph_max_rows.bit_length())
        if runner.graph_max_rows >> i >= 16
    ]
    return sum(2 * len(runner.capacities(bucket)) for bucket in buckets)


def self_selecting(model_dir) -> Engine:
    """An engine as `graphed`'s, but each captured pass ranks its candidates itself (the plan's `selects_in_graph`:
    one sort in the graph; the host only gathers each request's first rows), and a pass holds up to 64 rows."""
    RecordedGraph.made = []
    config = SchedulerConfig(prefix_cache_bytes=0, prefill_tokens_per_step=64)
    plan = graphed_plan(RecordedGraph, selects_in_graph=True)
    engine = Engine.from_pretrained(model_dir, cuda_graph_max_rows=64, scheduler=config, plan=plan)
    assert engine.scheduler.idle
    assert all(batch.selection is not None and len(batch.outputs) == 2 for batch, _ in engine.runner._captured.values())
    return engine


@pytest.fixture
def selecting(tiny_dir):
    """Room in a pass for requests of two levels."""
    return self_selecting(tiny_dir)


def constrained(engine, rng) -> list[RetrieveRequest]:
    """Requests of several widths, one with an allow-list smaller than its width, one excluding items, one with a
    widening schedule."""
    items = engine.catalog.item_ids
    asked = retrieves(engine, rng, [9, 12, 30, 11])
    changes = [
        {"allowed_item_ids": list(items[::3])},
        {"exclude_item_ids": list(items[:40:2])},
        {"allowed_item_ids": list(items[5:11])},  # 6 items for 30 beams: the other rows score -inf
        {"beam_widths": [2, 5, 11]},
    ]
    return [r.model_copy(update=change) for r, change in zip(asked, changes, strict=True)]


def test_captured_passes_that_select_themselves_return_what_the_eager_selection_does(selecting, engine, rng):
    captured = list(RecordedGraph.made)
    state = rng.get_state()
    asked = constrained(selecting, rng)
    with no_sync():
        got = selecting.retrieve(asked)
    rng.set_state(state)
    want = engine.retrieve(constrained(engine, rng))
    assert RecordedGraph.made == captured and selecting.runner.uncaptured_passes == 0
    assert sum(g.replays for g in captured[: decode_passes(selecting.runner)]) >= 3
    for a, b in zip(got, want, strict=True):
        assert [i.item_id for i in a.items] == [i.item_id for i in b.items]
        assert np.allclose([i.logprob for i in a.items], [i.logprob for i in b.items], atol=1e-4)
    items = selecting.catalog.item_ids
    assert {i.item_id for i in got[0].items} <= set(items[::3]) and len(got[2].items) == 6
    assert not set(items[:40:2]) & {i.item_id for i in got[1].items}


def test_a_self_selecting_pass_over_cohorts_of_two_levels_selects_each_as_the_eager_selection(selecting, rng):
    """Straight through the runner (no scheduler to retry a failed pass one request at a time): one cohort runs a
    level ahead, so each replayed pass holds two selections, and the later one's requests start past the first's."""
    from genrec.engine.beam import fetch_finals
    from genrec_bench.gpu_check import pooled_cohorts

    state = rng.get_state()
    asked = [selecting.prepare(r) for r in constrained(selecting, rng)]
    rng.set_state(state)
    again = [selecting.prepare(r) for r in constrained(selecting, rng)]
    graphed = pooled_cohorts(selecting, asked, selecting.scheduler.budget.pool)  # the pool its graphs were captured for
    eager = pooled_cohorts(selecting, again, selecting.runner.new_pool(4096))
    runner, replays = selecting.runner, sum(g.replays for g in RecordedGraph.made)
    runner.decode(graphed[2:])  # the widest and the scheduled one run ahead
    runner.decode(eager[2:], bucketed=False)
    with no_sync():
        runner.decode(graphed)  # levels 1 and 2 in one pass: two selections
    runner.decode(eager, bucketed=False)
    runner.decode([c for c in graphed if not c.done])
    runner.decode([c for c in eager if not c.done], bucketed=False)
    assert all(c.done for c in graphed) and sum(g.replays for g in RecordedGraph.made) == replays + 3
    finals = zip(graphed, fetch_finals(graphed), eager, fetch_finals(eager), strict=True)
    for g_cohort, g_host, e_cohort, e_host in finals:  # their beams, rows that found no item (-inf) dropped
        (g_beams,), (e_beams,) = g_cohort.results(g_host), e_cohort.results(e_host)
        assert [item for item, _ in g_beams] == [item for item, _ in e_beams]
        assert np.allclose([s for _, s in g_beams], [s for _, s in e_beams], atol=1e-5)


def test_a_pass_wider_than_the_largest_capture_runs_eagerly_and_never_captures(graphed, engine, rng):
    assert graphed.scheduler.idle
    captured = list(RecordedGraph.made)
    state = rng.get_state()
    (got,) = graphed.retrieve(retrieves(graphed, rng, [64]))  # one request of 64 rows: no bucket holds it
    rng.set_state(state)
    (want,) = engine.retrieve(retrieves(engine, rng, [64]))
    assert RecordedGraph.made == captured and graphed.runner.uncaptured_passes > 0
    assert [i.item_id for i in got.items] == [i.item_id for i in want.items]


def test_the_scheduler_splits_decode_rows_into_passes_a_capture_holds():
    from types import SimpleNamespace

    from genrec.engine.scheduler import _passes

    def holds(rows: list[int]) -> bool:  # a pass of at most 32 rows of at most 3 requests
        return sum(rows) <= 32 and len(rows) <= 3

    jobs = [SimpleNamespace(cohort=SimpleNamespace(rows=n)) for n in (10, 20, 5, 40, 1, 2, 3, 4)]
    groups = _passes(jobs, holds)
    assert [[j.cohort.rows for j in g] for g in groups] == [[10, 20], [5], [40], [1, 2, 3], [4]]
    jobs = [SimpleNamespace(cohort=SimpleNamespace(rows=n)) for n in (0, 32, 0)]  # a job of no rows first
    assert [[j.cohort.rows for j in g] for g in _passes(jobs, holds)] == [[0, 32, 0]]
    assert _passes(jobs, lambda rows: True) == [jobs] and _passes([], holds) == []


def test_every_decode_graph_writes_into_one_set_of_outputs(graphed):
    """The outputs are held once for all buckets (the largest's), not once per captured graph; a pass returns each
    row's log-probabilities at the children any node may have, never [rows, vocab], and no K/V: it writes them into
    the pool itself."""
    assert graphed.scheduler.idle
    outputs = [batch.outputs for batch, _ in graphed.runner._captured.values()]
    assert len(outputs) == decode_passes(graphed.runner) and {o[0].shape[0] for o in outputs} == {16, 32}
    columns = graphed.family.max_children
    assert {o[0].shape[1] for o in outputs} == {columns} and columns < graphed.model.config.vocab_size
    for (gains,) in outputs:
        assert gains.data_ptr() == outputs[0][0].data_ptr()


def test_a_failed_capture_leaves_no_scheduler_and_the_next_use_captures_again(tiny_dir):
    config = SchedulerConfig(prefix_cache_bytes=0, prefill_tokens_per_step=64)
    failures = [RuntimeError("capture failed")]

    def failing_once(forward):
        if failures:
            raise failures.pop()
        return RecordedGraph(forward)

    engine = Engine.from_pretrained(tiny_dir, cuda_graph_max_rows=32, scheduler=config, plan=graphed_plan(failing_once))
    with pytest.raises(RuntimeError, match="capture failed"):
        _ = engine.scheduler
    assert engine._scheduler is None
    RecordedGraph.made = []
    assert engine.scheduler.idle and len(RecordedGraph.made) > 4


def test_a_catalog_load_and_a_filter_make_no_device_tensors_outside_the_engine_thread(engine):
    """Built on the host in the caller's thread; the device copies are made by the engine's thread at first use.
    (`meta` stands in for a device here: anything made on it outside `device_trie` / `FilterMask.on` would show.)"""
    from genrec.api import RetrieveRequest as R
    from genrec.engine.served_catalog import ServedCatalog

    layout = engine.family.layout
    served = ServedCatalog.build(engine.catalog, layout, torch.device("meta"))
    host = [t for t in (*served.trie.ptr, *served.trie.token, *served.trie.child) if t is not None]
    assert all(t.device.type == "cpu" for t in host)
    item = engine.catalog.item_ids[0]
    mask = served.filters.get(R(prompt_token_ids=[1, 2], beam_width=2, allowed_item_ids=[item]))
    assert all(t.device.type == "cpu" for t in mask.nodes)
    assert served.device_trie().ptr[0].device.type == "meta" and served.device_trie() is served.device_trie()
    assert all(t.device.type == "meta" for t in mask.on("meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the race needs a CUDA device (gpu_check runs it too)")
def test_on_cuda_other_threads_device_work_never_breaks_the_graphed_decode(tiny_dir):
    """`bench load --cuda-fast`'s pattern: an AsyncEngine on CUDA (fast path by default) serves requests of many
    widths while other threads prepare prompts from the catalog and run their own CUDA work. Before, a bucket was
    captured on its first live pass and such work broke the capture ("operation not permitted when stream is
    capturing"); now every bucket is captured at start and live passes only replay."""
    import threading

    from genrec.engine import AsyncEngine

    served = AsyncEngine.from_pretrained(tiny_dir, device="cuda")
    assert served.engine.runner.graphs and served.engine.runner.warmup_s is not None
    stop, errors = threading.Event(), []

    def other_cuda_work():
        while not stop.is_set():
            (torch.randn(256, 256, device="cuda") @ torch.randn(256, 256, device="cuda")).sum().item()

    noise = threading.Thread(target=other_cuda_work)
    noise.start()
    try:
        rng = torch.Generator().manual_seed(0)
        futures = []
        for i in range(60):
            width = [1, 5, 17, 40, 130][i % 5]
            prompt = random_prompt(served.engine, 30 + i, rng)
            futures.append(served.submit(RetrieveRequest(prompt_token_ids=prompt, beam_width=width)))
        for future in futures:
            try:
                assert future.result(timeout=120).items
            except Exception as err:  # noqa: BLE001 - collected: every failure is reported below
                errors.append(repr(err))
    finally:
        stop.set()
        noise.join()
        served.shutdown()
    assert errors == [] and served.engine.runner.uncaptured_passes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA engine's start")
def test_on_cuda_a_float32_engine_starts_and_serves_without_graphs(tiny_dir, engine):
    """float32 has no FlashAttention kernel (its attention reads index tables on the host): the fast path's graphs
    stay off, and it answers as the CPU does."""
    cuda = Engine.from_pretrained(tiny_dir, device="cuda", dtype=torch.float32)
    assert not cuda.runner.graphs and cuda.scheduler.idle
    g = torch.Generator().manual_seed(4)
    requests = [RetrieveRequest(prompt_token_ids=random_prompt(cuda, 40, g), beam_width=9)]
    (got,), (want,) = cuda.retrieve(requests), engine.retrieve(requests)
    assert [i.item_id for i in got.items] == [i.item_id for i in want.items]


def warmed(model_dir):
    """An engine whose pieces compile (Dynamo alone here, backend "eager") starts as on CUDA: after its own warm-up
    requests."""
    from genrec.engine.plan import ExecutionPlan
    from genrec.model import fused
    from genrec.model.ops import ModelOps

    plan = ExecutionPlan(torch.device("cpu"), ModelOps(fused.compiled("eager")))
    engine = Engine.from_pretrained(model_dir, scheduler=SchedulerConfig(prefix_cache_bytes=0), plan=plan)
    assert plan.compiles
    ran = []
    requests = engine.family.warmup_requests
    engine.family.warmup_requests = lambda: ran.extend(requests()) or list(ran)
    assert engine.scheduler.idle  # it starts: the warm-up runs here
    return engine, ran


def test_an_engine_whose_pieces_compile_warms_up_on_its_own_requests_of_two_sizes_and_counts_none(tiny_dir, engine):
    warm, ran = warmed(tiny_dir)
    kinds = sorted(type(r).__name__ for r in ran)
    assert kinds == ["RetrieveRequest", "RetrieveRequest", "ScoreRequest", "ScoreRequest"]
    sizes = {(type(r).__name__, len(r.prompt_token_ids), getattr(r, "beam_width", None)) for r in ran}
    assert len(sizes) == 4  # each kind at two sizes: a compiled piece's second size makes its shapes dynamic
    assert warm.runner.warmup_s > 0 and warm.scheduler.metrics.snapshot()["requests"] == {}
    assert warm.scheduler.metrics.steps == 0 and warm.scheduler.cache.stats.tokens_prompted == 0
    request = RetrieveRequest(prompt_token_ids=list(range(5, 40)), beam_width=6)
    (got,), (want,) = warm.retrieve([request]), engine.retrieve([request])  # the warm-up left nothing behind
    assert [i.item_id for i in got.items] == [i.item_id for i in want.items]
    assert np.allclose([i.logprob for i in got.items], [i.logprob for i in want.items], atol=1e-5)


def test_a_ranker_whose_pieces_compile_warms_up_on_ranks_of_two_sizes(hstu_dir, ranker):
    from genrec.api import Event, RankRequest

    warm, ran = warmed(hstu_dir)
    assert [(type(r).__name__, len(r.history), len(r.candidates)) for r in ran] == [
        ("RankRequest", 8, 2),
        ("RankRequest", 12, 3),
    ]
    assert warm.scheduler.metrics.snapshot()["requests"] == {}
    items = warm.catalog.item_ids.tolist()
    request = RankRequest(history=[Event(item_id=i) for i in items[3:20]], candidates=items[:5])
    (got,), (want,) = warm.rank([request]), ranker.rank([request])
    assert [i.item_id for i in got.items] == [i.item_id for i in want.items]
    for a, b in zip(got.items, want.items, strict=True):
        assert a.scores == pytest.approx(b.scores, abs=1e-5)


def test_a_start_captures_in_one_session_and_reports_what_the_captures_hold(tiny_dir):
    """CUDA's caching allocator reuses a freed block only on the stream that freed it: every graph of a start is
    captured in ONE session (one side stream, one pool), not a stream per graph (393 streams once: nothing
    recycled, ~6-8 GB per engine). /v1/model's `execution` says what the captures hold."""
    from tests.plans import RecordingCapture

    RecordedGraph.made = []
    config = SchedulerConfig(prefix_cache_bytes=0, prefill_tokens_per_step=64)
    engine = Engine.from_pretrained(
        tiny_dir, cuda_graph_max_rows=32, scheduler=config, plan=graphed_plan(RecordedGraph)
    )
    opened = RecordingCapture.opened
    assert engine.scheduler.idle and RecordingCapture.opened == opened + 1
    described = engine.describe_execution()
    assert described["captured_decode_passes"] == decode_passes(engine.runner) == len(engine.runner._captured)
    assert described["captured_prefill_buckets"] == 3 and described["cuda_graphs"]
    largest = engine.runner._captured[max(engine.runner._captured, key=lambda k: (k[1], k[2], k[3]))][0]
    assert described["static_buffer_bytes"] > sum(t.nbytes for t in largest.outputs)  # outputs and inputs, counted once
    assert described["graph_bytes"] == 0  # measured on CUDA only


class CudaCalls:
    """torch.cuda's capture calls, recorded on the CPU: streams and pools made, graphs captured, and on which."""

    def __init__(self, monkeypatch):
        import contextlib

        self.streams, self.pools, self.graphs = [], [], []
        calls = self

        class Stream:
            def __init__(self, device=None):
                calls.streams.append(self)

            def wait_stream(self, other):
                pass

        class Graph:
            def replay(self):
                raise AssertionError("no replay at start")

        @contextlib.contextmanager
        def graph(g, pool=None, stream=None, capture_error_mode=None):
            calls.graphs.append((stream, pool))
            yield

        def pool_handle():
            calls.pools.append(object())
            return calls.pools[-1]

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", pool_handle)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", graph)


class StreamPerGraph:
    """The planted defect, as the runner captured before: a new side stream for every graph (one shared pool)."""

    def __init__(self, device):
        self.pool = torch.cuda.graph_pool_handle()

    def graph(self, forward):
        from genrec.engine.plan import CudaGraph

        return CudaGraph(forward, torch.cuda.Stream(), self.pool)


@pytest.mark.parametrize("capture", ["CudaCapture", "planted"])
def test_the_cuda_capture_session_makes_one_stream_and_one_pool_for_every_graph(tiny_dir, monkeypatch, capture):
    """The CUDA plan's own capture code (genrec.engine.plan.CudaCapture) through an engine's start, torch.cuda's
    calls recorded: one stream and one pool for all its graphs; the planted stream-per-graph capture fails."""
    from genrec.engine.plan import CudaCapture

    session = CudaCapture if capture == "CudaCapture" else StreamPerGraph
    calls = CudaCalls(monkeypatch)
    config = SchedulerConfig(prefix_cache_bytes=0, prefill_tokens_per_step=64)
    plan = dataclasses.replace(graphed_plan(RecordedGraph), capture=session)
    engine = Engine.from_pretrained(tiny_dir, cuda_graph_max_rows=32, scheduler=config, plan=plan)
    assert engine.scheduler.idle and len(calls.graphs) > 20
    on = {id(stream) for stream, _ in calls.graphs}
    assert len(calls.pools) == 1 and {id(pool) for _, pool in calls.graphs} == {id(calls.pools[0])}
    if capture == "planted":
        assert len(on) == len(calls.graphs)
    else:
        assert len(on) == 1 and len(calls.streams) - len(calls.graphs) * 2 == 1  # 2 current_stream() per graph
