"""`genrec bench returning --serve`, its parts without Ray: the request sequence (users, their growing prompts),
the replay (a user's requests in order, bounded concurrency), and the reuse rate summed over replicas. The
Serve runs themselves are a command (docs/benchmarks.md: the figures), not a test."""

import asyncio

import pytest

from genrec.engine import Engine
from genrec_bench.returning import _reuse, in_process, replay, request_sequence


@pytest.fixture(scope="module")
def bench_engine(tiny_dir):
    return Engine.from_pretrained(tiny_dir)


def test_the_sequence_is_first_visits_then_returning_users_growing_prompts(bench_engine):
    first_visits, sequence = request_sequence(bench_engine, events=30, k=2, users=4, new_share=0.0, requests=12)
    assert [user for user, _ in first_visits] == [0, 1, 2, 3]
    last = {user: request.prompt_token_ids for user, request in first_visits}
    for user, request in sequence:
        assert user in last
        previous, tokens = last[user][:-1], request.prompt_token_ids  # the soft token ends every prompt
        assert tokens[: len(previous)] == previous or len(tokens) < len(previous)  # grown, or truncated
        last[user] = tokens


def test_replay_keeps_each_users_order_and_the_concurrency():
    sequence = [(u % 3, i) for i, u in enumerate(range(12))]
    seen, in_flight, peak = [], 0, 0

    async def call(user, request):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.001 * (request % 4))
        seen.append((user, request))
        in_flight -= 1

    asyncio.run(replay(call, sequence, concurrency=2))
    assert peak <= 2 and sorted(seen) == sorted(sequence)
    for user in range(3):
        assert [r for u, r in seen if u == user] == [r for u, r in sequence if u == user]


def test_the_single_replica_baseline_reuses_the_returning_users_prompts(bench_engine):
    first_visits, sequence = request_sequence(bench_engine, events=40, k=2, users=3, new_share=0.0, requests=6)
    result = in_process(bench_engine, first_visits, sequence, concurrency=2, kv_budget_bytes=64 << 20)
    assert result["per_replica"]["in_process"]["requests"] == 6
    assert result["tokens_prompted"] == sum(len(r.prompt_token_ids) for _, r in sequence)
    assert result["reuse_rate"] > 0.5


def test_the_reuse_rate_sums_over_replicas_between_snapshots():
    before = {"a": {"requests": 1, "tokens_prompted": 100, "tokens_reused": 0}}
    after = {
        "a": {"requests": 3, "tokens_prompted": 300, "tokens_reused": 150},
        "b": {"requests": 1, "tokens_prompted": 100, "tokens_reused": 0},
    }
    result = _reuse(before, after, seconds=2.0, count=3)
    assert result["reuse_rate"] == 150 / 300 and result["requests_per_s"] == 1.5
    assert result["per_replica"]["b"] == {"requests": 1, "tokens_prompted": 100, "tokens_reused": 0}
