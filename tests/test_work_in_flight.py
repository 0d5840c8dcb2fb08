"""The work an engine holds (`Scheduler.work_of`, `work_in_flight`): what each engine replica reports to Serve's
autoscaler (genrec.serving.autoscaling), so a wide beam over a long prompt weighs what it costs."""

import threading
from types import SimpleNamespace

import torch

from genrec.api import RetrieveRequest
from genrec.engine import AsyncEngine, Engine, SchedulerConfig
from genrec.engine.pass_cost import PassCost
from genrec.engine.retriever import PreparedPrompt, Retriever
from genrec.engine.scheduler import Scheduler
from genrec.errors import RequestTimeout
from genrec.serving.autoscaling import WORK_METRIC
from genrec.serving.engine_server import EngineServer
from tests.conftest import ManualClock, random_prompt
from tests.test_autoscaling_policy import NARROW, TYPICAL, WIDE

# Qwen3-1.7B's shape: what the GPU configs' target is worked out for.
QWEN3_1_7B = SimpleNamespace(
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, hidden_size=2048, intermediate_size=6144
)
HSTU_256 = {"num_attention_heads": 4, "head_dim": 64, "hidden_size": 256}


def run(scheduler):
    while not scheduler.idle:
        scheduler.step()


def work_on_qwen3_1_7b(beam: int, context: int, levels: int = 5) -> int:
    """A retrieve's work as an engine of that model counts it (its KV tokens as the retriever counts them)."""
    request = RetrieveRequest(prompt_token_ids=[1] * context, beam_width=beam)
    prepared = PreparedPrompt(request, "retrieve", torch.zeros(context, dtype=torch.int64))
    prepared.kv_tokens = Retriever._kv_tokens(SimpleNamespace(levels=levels), prepared)
    engine = SimpleNamespace(family=SimpleNamespace(cost=PassCost.qwen3(QWEN3_1_7B)))
    return Scheduler.work_of(engine, prepared)


def test_the_documented_figures_are_the_engines():
    """docs/serving.md and the policy's tests quote these; the configs' target is 24 typical requests."""
    assert (work_on_qwen3_1_7b(1024, 5000), work_on_qwen3_1_7b(30, 2000), work_on_qwen3_1_7b(8, 100)) == (
        WIDE,
        TYPICAL,
        NARROW,
    )
    assert 100 < WIDE / NARROW < 150  # a hundred narrow requests' worth, where the request count says one
    assert round(24 * TYPICAL, -3) == 64_000
    # funnel-gpu.yaml's ranker: 32 rankings of 2,000 events and 500 candidates on an HSTU of hidden 256 (the
    # `tiny` preset's shape); a ranking holds its events and scores a row per candidate
    hstu = SimpleNamespace(family=SimpleNamespace(cost=PassCost.hstu(SimpleNamespace(**HSTU_256))))
    ranking = SimpleNamespace(token_ids=torch.zeros(2000, 3), kv_tokens=2000, scored_rows=500)
    assert 32 * Scheduler.work_of(hstu, ranking) == 580_000


def test_work_grows_with_rows_and_context_and_is_given_back_when_requests_end(engine, rng):
    scheduler = Scheduler(engine.family, engine.runner, SchedulerConfig(prefix_cache_bytes=0))

    def prepared(beam: int, context: int):
        return engine.prepare(RetrieveRequest(prompt_token_ids=random_prompt(engine, context, rng), beam_width=beam))

    narrow, wide_beam, long_prompt, both = prepared(2, 10), prepared(32, 10), prepared(2, 200), prepared(32, 200)
    works = [scheduler.work_of(p) for p in (narrow, wide_beam, long_prompt, both)]
    assert works[0] < works[1] < works[3] and works[0] < works[2] < works[3]
    assert works[3] > 10 * works[0]
    for p in (narrow, both):
        scheduler.submit(p)
    assert scheduler.work_in_flight == works[0] + works[3]  # queued work counts, from the submit on
    run(scheduler)
    assert scheduler.work_in_flight == 0


def test_work_of_a_request_that_times_out_or_is_cancelled_is_given_back_too(engine, rng):
    clock = ManualClock()
    scheduler = Scheduler(engine.family, engine.runner, SchedulerConfig(prefix_cache_bytes=0), clock=clock)
    request = RetrieveRequest(prompt_token_ids=random_prompt(engine, 30, rng), beam_width=8)
    late, cancelled = scheduler.submit(engine.prepare(request), 1.0), scheduler.submit(engine.prepare(request), 60.0)
    assert scheduler.work_in_flight == 2 * scheduler.work_of(engine.prepare(request))
    cancelled.cancel()
    clock.advance(2.0)
    run(scheduler)
    assert isinstance(late.exception(), RequestTimeout)
    assert scheduler.work_in_flight == 0


def test_concurrent_submitters_lose_no_work(engine, rng):
    """Each running sum has one writer (the submitters, one at a time; the loop), so none loses an update."""
    async_engine = AsyncEngine(Engine(engine.family, SchedulerConfig(prefix_cache_bytes=0, max_running=4)))
    futures, lock = [], threading.Lock()
    prompts = [random_prompt(engine, 5 + 3 * i, rng) for i in range(24)]

    def submit(some):
        for prompt in some:
            future = async_engine.submit(RetrieveRequest(prompt_token_ids=prompt, beam_width=4), 60.0)
            with lock:
                futures.append(future)

    try:
        threads = [threading.Thread(target=submit, args=(prompts[i::4],)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for future in futures:
            future.result(timeout=120)
        scheduler = async_engine.scheduler
        assert scheduler.work_submitted > 0 and async_engine.work_in_flight == 0
    finally:
        async_engine.shutdown()


def test_the_replica_reports_its_engines_work_to_serve():
    replica = SimpleNamespace(driver=SimpleNamespace(work_in_flight=12_345))
    assert EngineServer.func_or_class.record_autoscaling_stats(replica) == {WORK_METRIC: 12_345.0}
