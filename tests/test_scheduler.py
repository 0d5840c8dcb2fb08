"""The scheduler as the one path: job states and their moves, retries that never re-run a finished job, and the
synchronous Engine stepping the same scheduler."""

import pytest

from genrec.api import Candidate, RetrieveRequest, ScoreRequest
from genrec.engine import results
from genrec.engine.job import Job, JobState
from genrec.engine.scheduler import Scheduler, SchedulerConfig
from tests.conftest import random_prompt


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
    scheduler = Scheduler(engine, SchedulerConfig(prefill_tokens_per_step=16))
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
    scheduler = Scheduler(engine)
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
