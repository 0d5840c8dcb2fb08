"""Continuous batching: the AsyncEngine and its scheduler against the synchronous Engine."""

import asyncio
import time

import pytest

from genrec.api import Candidate, RecommendRequest, RetrieveRequest, ScoreRequest
from genrec.engine import AsyncEngine, Engine, SchedulerConfig
from genrec.engine.job import JobState
from genrec.engine.scheduler import Scheduler
from genrec.errors import EngineStopped, InvalidRequestError, Overloaded, RequestTimeout
from tests.conftest import ManualClock, random_prompt


def mixed_requests(engine, rng, n):
    requests = []
    for i in range(n):
        prompt = random_prompt(engine, 3 + (i * 7) % 60, rng)
        kind = i % 3
        if kind == 0:
            requests.append(RetrieveRequest(prompt_token_ids=prompt, beam_width=1 + (i * 5) % 40, request_id=str(i)))
        elif kind == 1:
            candidates = [Candidate(item_id=engine.catalog.item_ids[(i * 13 + j) % 300]) for j in range(1 + i % 9)]
            requests.append(ScoreRequest(prompt_token_ids=prompt, candidates=candidates, request_id=str(i)))
        else:
            requests.append(
                RecommendRequest(
                    prompt_token_ids=prompt,
                    beam_width=2 + i % 6,
                    candidates=[Candidate(text="news")],
                    request_id=str(i),
                )
            )
    return requests


def run_alone(engine, request):
    if isinstance(request, RecommendRequest):
        return engine.recommend([request])[0]
    if isinstance(request, RetrieveRequest):
        return engine.retrieve([request])[0]
    return engine.score([request])[0]


def assert_same(got, want):
    if hasattr(want, "scores"):
        assert [s.logprob for s in got.scores] == pytest.approx([s.logprob for s in want.scores], abs=1e-4)
        return
    assert [(i.item_id, i.source if hasattr(i, "source") else None) for i in got.items] == [
        (i.item_id, i.source if hasattr(i, "source") else None) for i in want.items
    ]
    key = "score_logprob" if hasattr(want.items[0], "score_logprob") else "logprob"
    assert [getattr(i, key) for i in got.items] == pytest.approx([getattr(i, key) for i in want.items], abs=1e-4)


async def call(async_engine, request, **kw):
    if isinstance(request, RecommendRequest):
        return await async_engine.recommend(request, **kw)
    if isinstance(request, RetrieveRequest):
        return await async_engine.retrieve(request, **kw)
    return await async_engine.score(request, **kw)


@pytest.fixture
def async_engine(engine):
    ae = AsyncEngine(Engine(engine.family, SchedulerConfig(prefill_tokens_per_step=64, max_running=16)))
    yield ae
    ae.shutdown()


def test_fifty_concurrent_mixed_requests_equal_one_by_one(engine, async_engine, rng):
    requests = mixed_requests(engine, rng, 50)

    async def all_at_once():
        return await asyncio.gather(*(call(async_engine, r) for r in requests))

    results = asyncio.run(all_at_once())
    for request, result in zip(requests, results, strict=True):
        assert result.request_id == request.request_id
        assert_same(result, run_alone(engine, request))
    metrics = async_engine.metrics()
    assert metrics["requests"] == {"retrieve:ok": 17, "score:ok": 17, "recommend:ok": 16}
    assert metrics["batch_rows_per_step"]["count"] > 0 and metrics["latency"]["retrieve"]["count"] == 17
    assert metrics["batch_rows_per_step"]["p99"] > max(r.beam_width for r in requests if hasattr(r, "beam_width"))
    assert async_engine.kv_bytes_reserved == 0


def test_chunked_prefill_gives_the_same_results(engine, rng):
    scheduler = Scheduler(engine.family, engine.runner, SchedulerConfig(prefill_tokens_per_step=5))
    requests = [RetrieveRequest(prompt_token_ids=random_prompt(engine, 37, rng), beam_width=9) for _ in range(3)]
    futures = [scheduler.submit(engine.prepare(r)) for r in requests]
    steps = 0
    while not scheduler.idle:
        scheduler.step()
        steps += 1
    assert steps > 3 * 37 // 5  # the prompts really were split across iterations
    for request, future in zip(requests, futures, strict=True):
        assert_same(future.result(), engine.retrieve([request])[0])


def test_cancellation_frees_kv_at_once(engine, rng):
    scheduler = Scheduler(engine.family, engine.runner, SchedulerConfig(prefill_tokens_per_step=8))
    long_one = scheduler.submit(engine.prepare(RetrieveRequest(prompt_token_ids=random_prompt(engine, 200, rng))))
    scheduler.step()
    assert scheduler.budget.reserved > 0 and scheduler.in_state(JobState.PREFILLING)
    long_one.cancel()
    scheduler.step()
    assert scheduler.budget.reserved == 0 and scheduler.idle
    assert scheduler.metrics.requests[("retrieve", "cancelled")] == 1


def test_cancelled_await_frees_kv(engine, rng):
    ae = AsyncEngine(Engine(engine.family, SchedulerConfig(prefill_tokens_per_step=4)))

    async def cancel_midway():
        task = asyncio.ensure_future(ae.retrieve(RetrieveRequest(prompt_token_ids=random_prompt(engine, 300, rng))))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    deadline = time.monotonic() + 5
    while (ae.kv_bytes_reserved or not ae.scheduler.idle) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ae.kv_bytes_reserved == 0
    ae.shutdown()


def test_timeout_fails_the_request_and_frees_kv(engine, rng):
    clock = ManualClock()
    scheduler = Scheduler(engine.family, engine.runner, SchedulerConfig(prefill_tokens_per_step=4), clock)
    future = scheduler.submit(engine.prepare(RetrieveRequest(prompt_token_ids=random_prompt(engine, 100, rng))), 0.01)
    scheduler.step()
    assert not future.done()
    clock.advance(0.02)
    scheduler.step()
    with pytest.raises(RequestTimeout):
        future.result(timeout=1)
    assert scheduler.budget.reserved == 0


def test_overload_is_refused_fast(engine, rng):
    scheduler = Scheduler(engine.family, engine.runner, SchedulerConfig(max_queue=3))
    request = engine.prepare(RetrieveRequest(prompt_token_ids=random_prompt(engine, 10, rng)))
    for _ in range(3):
        scheduler.submit(request)
    start = time.perf_counter()
    with pytest.raises(Overloaded, match="queue is full"):
        scheduler.submit(request)
    assert time.perf_counter() - start < 1  # no loop thread runs here: a submit that waited would never return


def test_a_request_that_does_not_fit_waits_for_memory(engine, rng):
    request = engine.prepare(RetrieveRequest(prompt_token_ids=random_prompt(engine, 30, rng), beam_width=8))
    one = Scheduler(engine.family, engine.runner).per_token * request.kv_tokens
    scheduler = Scheduler(engine.family, engine.runner, SchedulerConfig(kv_budget_bytes=one))
    first, second = scheduler.submit(request), scheduler.submit(request)
    scheduler.step()
    assert len(scheduler.waiting) == 1 and scheduler.budget.reserved == one
    while not scheduler.idle:
        scheduler.step()
    assert first.result().items == second.result().items
    tokens = request.kv_tokens
    with pytest.raises(InvalidRequestError, match=f"needs {tokens} tokens of KV .* pool holds {tokens - 1} "):
        Scheduler(engine.family, engine.runner, SchedulerConfig(kv_budget_bytes=one - 1)).submit(request)


def test_a_failing_request_fails_alone_and_the_loop_keeps_serving(engine, async_engine, rng, monkeypatch):
    original = engine.family.context_embeds

    def sabotaged(prepared, *span):
        if prepared.request.request_id == "boom":
            raise RuntimeError("injected failure")
        return original(prepared, *span)

    monkeypatch.setattr(engine.family, "context_embeds", sabotaged)
    requests = mixed_requests(engine, rng, 9)
    bad = RetrieveRequest(prompt_token_ids=random_prompt(engine, 12, rng), request_id="boom")

    async def together():
        return await asyncio.gather(*(call(async_engine, r) for r in [bad, *requests]), return_exceptions=True)

    results = asyncio.run(together())
    assert isinstance(results[0], RuntimeError) and "injected" in str(results[0])
    for request, result in zip(requests, results[1:], strict=True):
        assert_same(result, run_alone(engine, request))
    monkeypatch.setattr(engine.family, "context_embeds", original)
    after = asyncio.run(asyncio.wait_for(call(async_engine, requests[0]), 30))
    assert_same(after, run_alone(engine, requests[0]))


def test_invalid_requests_raise_before_queueing(engine, async_engine):
    with pytest.raises(InvalidRequestError, match="unknown item"):
        async_engine.submit(ScoreRequest(prompt="hi", candidates=[Candidate(item_id="nope")]))
    assert async_engine.scheduler.idle


def test_a_repeated_prompt_prefills_only_past_its_cached_blocks(engine, rng, monkeypatch):
    spans = []
    original = engine.family.context_embeds
    monkeypatch.setattr(engine.family, "context_embeds", lambda p, *span: spans.append(span) or original(p, *span))
    scheduler = Scheduler(engine.family, engine.runner)
    prompt = random_prompt(engine, 40, rng)
    user = "user-1"  # reuse is within a cache scope
    retrieve = scheduler.submit(
        engine.prepare(RetrieveRequest(prompt_token_ids=prompt, beam_width=5, cache_scope=user))
    )
    while not scheduler.idle:
        scheduler.step()
    top = [Candidate(item_id=i.item_id) for i in retrieve.result().items]
    score = scheduler.submit(engine.prepare(ScoreRequest(prompt_token_ids=prompt, candidates=top, cache_scope=user)))
    while not scheduler.idle:
        scheduler.step()
    assert spans == [(0, 40), (32, 40)]  # two whole blocks of 16 reused, the rest prefilled
    stats = scheduler.cache.stats
    assert (stats.hits, stats.tokens_reused, stats.tokens_prompted) == (1, 32, 80)
    assert_same(score.result(), engine.score([ScoreRequest(prompt_token_ids=prompt, candidates=top)])[0])


def test_an_error_in_the_loop_itself_fails_requests_instead_of_hanging(engine, rng, monkeypatch):
    ae = AsyncEngine(engine)
    monkeypatch.setattr(ae.scheduler, "_decode", lambda: (_ for _ in ()).throw(RuntimeError("loop bug")))
    future = ae.submit(RetrieveRequest(prompt_token_ids=random_prompt(engine, 10, rng), beam_width=3))
    with pytest.raises(RuntimeError, match="loop bug"):
        future.result(timeout=30)
    monkeypatch.undo()
    again = ae.submit(RetrieveRequest(prompt_token_ids=random_prompt(engine, 10, rng), beam_width=3))
    assert len(again.result(timeout=30).items) == 3
    assert ae.kv_bytes_reserved == 0
    ae.shutdown()


# -- shutdown, health, live limits -------------------------------------------------------------------------


def slow_requests(engine, rng, n=20):
    """Enough work that most are still queued or running a fraction of a second after submission."""
    return [RetrieveRequest(prompt_token_ids=random_prompt(engine, 200, rng), beam_width=64) for _ in range(n)]


def held_decode(engine, monkeypatch, seconds=0.5):
    """Every decode pass waits `seconds` first: nothing finishes in the first fraction of a second, however fast
    the machine (the shutdown tests then do not depend on its speed)."""
    original = engine.runner.decode
    monkeypatch.setattr(engine.runner, "decode", lambda *a, **k: time.sleep(seconds) or original(*a, **k))


async def submit_then_shutdown(ae, requests, wait_s, **shutdown):
    tasks = [asyncio.ensure_future(call(ae, r)) for r in requests]
    await asyncio.sleep(wait_s)
    started = time.monotonic()
    await asyncio.to_thread(ae.shutdown, **shutdown)
    took = time.monotonic() - started
    done, pending = await asyncio.wait(tasks, timeout=1.0)  # settled by shutdown: nothing left to wait for
    assert not pending, f"{len(pending)} of {len(tasks)} callers still waiting after shutdown"
    return [t.exception() or t.result() for t in tasks], took


def test_shutdown_fails_every_queued_and_running_request_promptly(engine, rng, monkeypatch):
    held = Engine(engine.family, SchedulerConfig(prefill_tokens_per_step=16, max_running=4))
    held_decode(held, monkeypatch)
    ae = AsyncEngine(held)
    outcomes, took = asyncio.run(submit_then_shutdown(ae, slow_requests(engine, rng), 0.2, timeout_s=10.0))
    stopped = [o for o in outcomes if isinstance(o, EngineStopped)]
    assert len(stopped) >= 10 and all(isinstance(o, EngineStopped) or o.items for o in outcomes)
    assert took < 5.0 and not ae.healthy
    with pytest.raises(EngineStopped):
        ae.submit(RetrieveRequest(prompt="user liked"))
    assert ae.kv_bytes_reserved == 0 and ae.scheduler.idle
    assert ae.metrics()["requests"].get("retrieve:stopped", 0) >= 1


def test_shutdown_with_drain_finishes_what_it_holds_and_refuses_new_requests(engine, rng):
    ae = AsyncEngine(Engine(engine.family, SchedulerConfig(prefill_tokens_per_step=64, max_running=8)))
    requests = slow_requests(engine, rng)[:6]

    async def drain_while_submitting():
        tasks = [asyncio.ensure_future(call(ae, r)) for r in requests]
        await asyncio.sleep(0.05)
        closing = asyncio.ensure_future(asyncio.to_thread(ae.shutdown, timeout_s=120.0, drain=True))
        while ae.healthy:
            await asyncio.sleep(0.005)
        with pytest.raises(EngineStopped, match="shut down"):
            ae.submit(requests[0])
        await closing
        return await asyncio.wait_for(asyncio.gather(*tasks), 1.0)

    results = asyncio.run(drain_while_submitting())
    for request, result in zip(requests, results, strict=True):
        assert_same(result, run_alone(engine, request))
    assert ae.kv_bytes_reserved == 0


def test_a_drain_that_runs_out_of_time_fails_the_rest(engine, rng, monkeypatch):
    held = Engine(engine.family, SchedulerConfig(prefill_tokens_per_step=8, max_running=2))
    held_decode(held, monkeypatch)
    ae = AsyncEngine(held)
    outcomes, took = asyncio.run(submit_then_shutdown(ae, slow_requests(engine, rng), 0.05, timeout_s=0.3, drain=True))
    assert took < 3.0
    assert sum(isinstance(o, EngineStopped) for o in outcomes) >= 10


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread dies on purpose
def test_a_dead_loop_is_unhealthy_and_refuses_requests(engine, monkeypatch):
    ae = AsyncEngine(engine)
    assert ae.healthy
    monkeypatch.setattr(ae.scheduler, "step", lambda: (_ for _ in ()).throw(SystemExit("loop gone")))
    ae._wake.set()
    ae._thread.join(5)
    assert not ae.healthy
    with pytest.raises(EngineStopped, match="not running"):
        ae.submit(RetrieveRequest(prompt="user liked"))
    ae.shutdown(timeout_s=1.0)


def test_reconfigure_changes_live_limits_and_validates_them(engine, rng):
    ae = AsyncEngine(engine)
    request = RetrieveRequest(prompt_token_ids=random_prompt(engine, 10, rng))
    try:
        config = ae.reconfigure(max_queue=1, request_timeout_s=5.0, max_running=3, prefill_tokens_per_step=32)
        assert (config.max_queue, config.max_running) == (1, 3) and ae.scheduler.config is config
        for fields, name in [
            ({"max_running": 0}, "max_running"),
            ({"prefill_tokens_per_step": 0}, "prefill_tokens_per_step"),
            ({"request_timeout_s": 0}, "request_timeout_s"),
            ({"max_queue": True}, "max_queue"),
            ({"kv_budget_bytes": 1 << 20}, "kv_budget_bytes"),  # sized once: not live
            ({"no_such_limit": 1}, "no_such_limit"),
        ]:
            with pytest.raises(InvalidRequestError) as caught:
                ae.reconfigure(**fields)
            assert caught.value.field == name
        assert ae.scheduler.config is config  # a refused change changes nothing
        assert len(asyncio.run(ae.retrieve(request)).items) == request.beam_width  # and it still serves
    finally:
        ae.shutdown()


def test_a_lower_max_queue_applies_to_the_next_submission(engine, rng):
    scheduler = Scheduler(engine.family, engine.runner)
    request = engine.prepare(RetrieveRequest(prompt_token_ids=random_prompt(engine, 10, rng)))
    scheduler.submit(request)
    scheduler.reconfigure(max_queue=1)
    with pytest.raises(Overloaded, match="1 waiting"):
        scheduler.submit(request)


@pytest.mark.parametrize(
    "fields",
    [
        {"prefill_tokens_per_step": 0},
        {"max_running": 0},
        {"max_queue": 0},
        {"request_timeout_s": 0},
        {"request_timeout_s": float("nan")},
        {"kv_budget_bytes": 0},
        {"prefix_cache_bytes": -1},
        {"max_running": 2.5},
    ],
)
def test_scheduler_config_refuses_values_that_would_stall(fields):
    with pytest.raises(InvalidRequestError, match=next(iter(fields))):
        SchedulerConfig(**fields)


def test_a_zero_or_negative_request_timeout_is_refused_not_defaulted(engine, rng):
    scheduler = Scheduler(engine.family, engine.runner)
    prepared = engine.prepare(RetrieveRequest(prompt_token_ids=random_prompt(engine, 5, rng)))
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(InvalidRequestError, match="timeout_s"):
            scheduler.submit(prepared, bad)
    assert scheduler.idle


def test_each_async_entry_takes_only_its_own_kind_and_submit_takes_any(engine, async_engine):
    score = ScoreRequest(prompt="user liked", candidates=[Candidate(text="news")])
    recommend = RecommendRequest(prompt="user liked", beam_width=3)
    for method, wrong in [(async_engine.retrieve, score), (async_engine.retrieve, recommend)]:
        with pytest.raises(InvalidRequestError, match=f"expected RetrieveRequest, got {type(wrong).__name__}"):
            asyncio.run(method(wrong))
    with pytest.raises(InvalidRequestError, match="expected ScoreRequest, got RecommendRequest"):
        asyncio.run(async_engine.score(recommend))
    with pytest.raises(InvalidRequestError, match="expected RecommendRequest, got ScoreRequest"):
        asyncio.run(async_engine.recommend(score))
    assert async_engine.scheduler.idle  # nothing was queued
    assert len(async_engine.submit(score).result(timeout=30).scores) == 1  # submit serves every kind
    with pytest.raises(InvalidRequestError, match="got dict"):
        async_engine.submit({"prompt": "user liked"})


def exit_mid_step(model_dir: str) -> None:
    """The child process: an engine whose loop is still inside a (held) step when the script returns."""
    import torch

    from genrec.engine import Engine

    engine = Engine.from_pretrained(model_dir)
    original = engine.runner.decode
    busy = torch.randn(700, 700)

    def held(*args, **kwargs):  # about a second inside torch kernels (outside the GIL), then the real pass
        for _ in range(200):
            busy @ busy
        return original(*args, **kwargs)

    engine.runner.decode = held
    ae = AsyncEngine(engine)
    ae.submit(RetrieveRequest(prompt_token_ids=list(range(3, 20)), beam_width=4))
    time.sleep(0.2)
    ae.shutdown(timeout_s=0.05)  # returns at once: the loop is still in its step
    print("ok")


def test_a_process_that_exits_while_the_loop_is_mid_step_exits_cleanly(tiny_dir):
    from tests.test_engine_robustness import run_isolated

    assert run_isolated("tests.test_async_engine:exit_mid_step", tiny_dir).strip() == "ok"  # no abort at exit


def test_every_request_handed_to_the_engine_is_counted_once_by_how_it_ended(engine, rng):
    """The one outcome count (genrec.engine.metrics): answered, refused at submit (invalid, full), and refused by
    a caller before submitting (`refused`)."""
    ae = AsyncEngine(Engine(engine.family, SchedulerConfig(max_queue=1)))
    try:
        ae.submit(RetrieveRequest(prompt_token_ids=random_prompt(engine, 8, rng))).result(timeout=60)
        with pytest.raises(InvalidRequestError):
            ae.submit(RetrieveRequest(prompt="user liked", beam_widths=[2]), kind="retrieve")
        with pytest.raises(InvalidRequestError):
            ae.submit(RetrieveRequest(prompt="user liked"), kind="score")
        ae.refused("retrieve", EngineStopped("a caller's refusal"))
        assert ae.metrics()["requests"] == {"retrieve:ok": 1, "retrieve:invalid": 1, "score:invalid": 1,
                                            "retrieve:stopped": 1}  # fmt: skip
    finally:
        ae.shutdown()
