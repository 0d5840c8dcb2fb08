"""The scheduler as the one path: job states and their moves, retries that never re-run a finished job, and the
synchronous Engine stepping the same scheduler."""

import time

import pytest
import torch

from genrec.api import Candidate, RetrieveRequest, ScoreRequest
from genrec.engine import results
from genrec.engine.job import Job, JobState
from genrec.engine.scheduler import Scheduler, SchedulerConfig
from tests.conftest import ManualClock, random_prompt


def run(scheduler):
    while not scheduler.idle:
        scheduler.step()


def test_a_job_moves_only_forward_along_its_states():
    job = Job(prepared=None, future=None, submitted=0.0, deadline=1.0, kv_tokens=1)
    job.move(JobState.PREFILLING)
    job.move(JobState.DECODING)
    with pytest.raises(RuntimeError, match="from decoding to prefilling"):
        job.move(JobState.PREFILLING)
    job.move(JobState.SCORING)
    job.move(JobState.FINISHED)
    with pytest.raises(RuntimeError, match="from finished"):
        job.move(JobState.FINISHED)  # settled once, never again


def test_every_state_is_visited_in_order_and_ends_finished(engine, rng, monkeypatch):
    seen: dict[str, list[str]] = {}
    original = Job.move

    def recording(job, state):
        seen.setdefault(job.prepared.request.request_id, []).append(state.value)
        original(job, state)

    monkeypatch.setattr(Job, "move", recording)
    scheduler = Scheduler(engine.family, engine.runner, SchedulerConfig(prefill_tokens_per_step=16))
    cands = [Candidate(item_id=i) for i in engine.catalog.item_ids[:3]]
    scheduler.submit(engine.prepare(RetrieveRequest(prompt_token_ids=random_prompt(engine, 40, rng), request_id="r")))
    scheduler.submit(
        engine.prepare(ScoreRequest(prompt_token_ids=random_prompt(engine, 9, rng), candidates=cands, request_id="s"))
    )
    run(scheduler)
    assert seen == {"r": ["prefilling", "decoding", "finished"], "s": ["prefilling", "scoring", "finished"]}


def test_a_retry_after_a_failure_never_runs_a_job_that_already_finished(engine, rng, monkeypatch):
    """Two score jobs share a pass; the first finishes, the second's result fails: the retry runs the second
    alone, and the first is settled exactly once (one 'ok', one 'error')."""
    original = results.score_result

    def failing(prepared, scores):
        if prepared.request.request_id == "bad":
            raise RuntimeError("injected")
        return original(prepared, scores)

    monkeypatch.setattr(results, "score_result", failing)
    scheduler = Scheduler(engine.family, engine.runner)
    cands = [Candidate(item_id=i) for i in engine.catalog.item_ids[:4]]
    good, bad = (
        scheduler.submit(
            engine.prepare(
                ScoreRequest(prompt_token_ids=random_prompt(engine, 12, rng), candidates=cands, request_id=rid)
            )
        )
        for rid in ("good", "bad")
    )
    run(scheduler)
    assert len(good.result().scores) == 4
    with pytest.raises(RuntimeError, match="injected"):
        bad.result()
    assert scheduler.metrics.requests == {("score", "ok"): 1, ("score", "error"): 1}
    scheduler.cache.clear()
    assert scheduler.budget.reserved == 0 and scheduler.budget.pool.used == 0


def test_the_synchronous_api_steps_the_engines_own_scheduler(engine, rng):
    before = engine.scheduler.metrics.steps
    requests = [RetrieveRequest(prompt_token_ids=random_prompt(engine, 30, rng), beam_width=4) for _ in range(3)]
    assert all(len(r.items) == 4 for r in engine.retrieve(requests))
    scheduler = engine.scheduler
    assert scheduler.metrics.steps > before and scheduler.idle and scheduler.budget.reserved == 0
    assert scheduler.budget.pool.used * scheduler.budget.pool.bytes_per_token == scheduler.cache.bytes


def test_a_batch_larger_than_the_queue_is_submitted_as_room_frees(tiny_dir, rng):
    from genrec.engine import Engine

    small = Engine.from_pretrained(tiny_dir, scheduler=SchedulerConfig(max_queue=2, max_running=2))
    requests = [RetrieveRequest(prompt_token_ids=random_prompt(small, 8 + i, rng), beam_width=3) for i in range(7)]
    got = small.retrieve(requests)  # 7 requests through a queue of 2: submitted as room frees, in order
    for request, result in zip(requests, got, strict=True):
        (alone,) = small.retrieve([request])
        assert [i.item_id for i in result.items] == [i.item_id for i in alone.items]
        assert result.items[0].logprob == pytest.approx(alone.items[0].logprob, abs=1e-5)


def big_score(engine, rng, n=40, length=30):
    """Many long candidates: with a small pass size, their scoring takes many passes."""
    cands = [Candidate(token_ids=random_prompt(engine, length, rng)) for _ in range(n)]
    return ScoreRequest(prompt_token_ids=random_prompt(engine, 20, rng), candidates=cands, request_id="big")


def test_a_request_of_many_candidates_scores_in_bounded_passes_and_others_run_between(tiny_dir, rng):
    from genrec.engine import Engine

    engine = Engine.from_pretrained(tiny_dir, score_max_tokens=64, scheduler=SchedulerConfig(prefix_cache_bytes=0))
    scheduler = engine.scheduler
    big = scheduler.submit(engine.prepare(big_score(engine, rng)))  # 40 rows of 30: 2 rows a pass
    small = scheduler.submit(engine.prepare(RetrieveRequest(prompt_token_ids=random_prompt(engine, 9, rng))))
    steps = 0
    while not small.done():
        scheduler.step()
        steps += 1
    assert not big.done() and scheduler.in_state(JobState.SCORING)  # the retrieve finished while it scores
    while not scheduler.idle:
        scheduler.step()
        steps += 1
    assert steps >= 20 and len(big.result().scores) == 40
    (alone,) = Engine.from_pretrained(tiny_dir, scheduler=SchedulerConfig(prefix_cache_bytes=0)).score(
        [big_score(engine, torch.Generator().manual_seed(1234))]
    )
    assert [s.logprob for s in big.result().scores] == pytest.approx([s.logprob for s in alone.scores], abs=1e-5)


def test_a_deadline_is_checked_between_scoring_passes(tiny_dir, rng):
    from genrec.engine import Engine
    from genrec.errors import RequestTimeout

    engine = Engine.from_pretrained(tiny_dir, score_max_tokens=64)
    clock = ManualClock()
    scheduler = Scheduler(engine.family, engine.runner, SchedulerConfig(prefix_cache_bytes=0), clock)
    future = scheduler.submit(engine.prepare(big_score(engine, rng)), timeout_s=2)
    while not scheduler.in_state(JobState.SCORING):
        assert not future.done(), future.exception()
        scheduler.step()
    scheduler.step()  # one scoring pass within its deadline
    assert not future.done()
    clock.advance(2.05)  # past its deadline, mid-scoring
    scheduler.step()
    with pytest.raises(RequestTimeout):
        future.result(timeout=0)
    assert scheduler.idle and scheduler.budget.reserved == 0


def test_the_candidate_tokens_of_one_request_are_capped(tiny_dir, rng):
    from genrec.engine import Engine
    from genrec.errors import InvalidRequestError

    engine = Engine.from_pretrained(tiny_dir, max_candidate_tokens=100)
    with pytest.raises(InvalidRequestError, match="candidates: more than this engine's limit of 100"):
        engine.score([big_score(engine, rng, n=4, length=30)])
    assert len(engine.score([big_score(engine, rng, n=3, length=30)])[0].scores) == 3


def test_a_step_stuck_past_its_limit_makes_the_engine_unhealthy_until_it_ends(engine, rng, monkeypatch):
    import threading

    from genrec.engine import AsyncEngine

    release = threading.Event()
    original = engine.runner.decode
    monkeypatch.setattr(engine.runner, "decode", lambda *a, **k: release.wait(10) and original(*a, **k))
    async_engine = AsyncEngine(engine, stall_s=0.2)
    try:
        future = async_engine.submit(RetrieveRequest(prompt_token_ids=random_prompt(engine, 9, rng), beam_width=3))
        deadline = time.monotonic() + 10
        while async_engine.healthy and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not async_engine.healthy and async_engine.metrics()["step_in_flight_s"] > 0.2
        release.set()
        assert len(future.result(timeout=10).items) == 3
        assert async_engine.healthy
    finally:
        release.set()
        async_engine.shutdown()
