"""Passes bounded by their estimated cost, attention included; one candidate's length capped; deadlines that hold
within one pass (issue #29 item 6: one long-candidate score request held its caller ~12x past its deadline)."""

import random
from types import SimpleNamespace

import pytest

from genrec.api import Candidate, Event, RankRequest, RetrieveRequest, ScoreRequest
from genrec.engine.job import JobState
from genrec.engine.pass_cost import PassCost
from genrec.engine.ranker import _row_chunks
from genrec.engine.scheduler import Scheduler, SchedulerConfig
from genrec.engine.scoring import CandidateRows, chunks
from genrec.errors import InvalidRequestError, RequestTimeout
from tests.conftest import ManualClock, random_prompt
from tests.test_text_limits import LongestText

COSTS = [PassCost(288.0, 48.0), PassCost(12288.0, 2048.0), PassCost(40.0, 40.0)]


def run(scheduler):
    while not scheduler.idle:
        scheduler.step()


# -- the pass builders against plain references -------------------------------------------------------------


def random_jobs(rnd):
    """Score jobs of random candidate lengths over contexts of random lengths (chunks reads only their lengths)."""
    return [
        CandidateRows(
            SimpleNamespace(length=rnd.randint(1, 3000)), [[0] * rnd.randint(1, 400)] * rnd.randint(0, 12), (1, 2)
        )
        for _ in range(rnd.randint(1, 6))
    ]


def plain_score_passes(jobs, budget, cost):
    """Rows in order; a pass closes when the next row would take its cost, recomputed from its rows, over budget."""
    passes, current = [], []
    for j, job in enumerate(jobs):
        for i, cand in enumerate(job.candidates):
            trial = [*current, (j, i, len(cand), job.ctx.length)]
            if current and pass_cost(trial, cost) > budget:
                passes.append(current)
                trial = trial[-1:]
            current = trial
    return [*passes, current] if current else passes


def pass_cost(rows, cost):
    """Rows padded to the widest, each over its own context."""
    return cost.rows(len(rows), max(r[2] for r in rows), sum(r[3] for r in rows))


@pytest.mark.parametrize("seed", range(40))
def test_scoring_passes_are_the_plain_greedy_ones_and_stay_within_budget_unless_one_row_does(seed):
    rnd = random.Random(seed)
    jobs, cost = random_jobs(rnd), rnd.choice(COSTS)
    budget = rnd.uniform(50, 40000)
    got = [
        [(j, seg.start + k, len(c), seg.job.ctx.length) for j, seg in zip(ch.job_index, ch.segments, strict=True)
         for k, c in enumerate(seg.candidates)]
        for ch in chunks(jobs, budget, cost)
    ]  # fmt: skip
    assert got == plain_score_passes(jobs, budget, cost)
    assert all(pass_cost(p, cost) <= budget or len(p) == 1 for p in got)


def plain_rank_passes(jobs, budget):
    passes, current, used = [], [], 0.0
    for j, (n, each) in enumerate(jobs):
        for row in range(n):
            if current and used + each > budget:
                passes.append(current)
                current, used = [], 0.0
            current.append((j, row))
            used += each
    return [*passes, current] if current else passes


@pytest.mark.parametrize("seed", range(40))
def test_ranking_passes_are_the_plain_greedy_ones_and_stay_within_budget_unless_one_row_does(seed):
    rnd = random.Random(seed)
    cost = PassCost.hstu(SimpleNamespace(num_attention_heads=2, head_dim=8, hidden_size=rnd.choice([32, 256])))
    jobs = [(rnd.randint(0, 50), cost.rows(1, 1, rnd.randint(0, 4000))) for _ in range(rnd.randint(1, 5))]
    budget = rnd.uniform(5, 600)
    got = [[(j, row) for j, a, b in part for row in range(a, b)] for part in _row_chunks(jobs, budget)]
    assert got == plain_rank_passes(jobs, budget)
    assert all(sum(jobs[j][1] for j, _ in p) <= budget * (1 + 1e-12) or len(p) == 1 for p in got)


@pytest.mark.parametrize("seed", range(20))
def test_the_longest_row_and_prefill_chunk_are_the_largest_that_fit(seed):
    rnd = random.Random(seed)
    cost, budget, start = rnd.choice(COSTS), rnd.uniform(0.5, 50000), rnd.randint(0, 40000)
    longest = cost.longest_row(budget)
    assert (longest == 0 or cost.rows(1, longest, 0) <= budget) and cost.rows(1, longest + 1, 0) > budget
    n = cost.prefill_fits(start, budget)
    assert (n == 0 or cost.prefill(start, n) <= budget) and cost.prefill(start, n + 1) > budget


def test_short_rows_cost_about_their_tokens_so_budgets_in_tokens_keep_their_meaning():
    shape = SimpleNamespace(
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, hidden_size=2048, intermediate_size=6144
    )  # Qwen3-1.7B: item codes of 3 tokens over a 500-token prompt
    cost = PassCost.qwen3(shape)
    assert cost.rows(1000, 3, 1000 * 500) < 1.05 * 3000
    assert cost.rows(1, 4000, 0) > 2.5 * 4000  # a long candidate pays for attention that grows with its square


# -- the engine ----------------------------------------------------------------------------------------------


def long_score(engine, rng, length, n=12, prompt=20):
    cands = [Candidate(token_ids=random_prompt(engine, length, rng)) for _ in range(n)]
    return ScoreRequest(prompt_token_ids=random_prompt(engine, prompt, rng), candidates=cands, request_id="long")


def test_a_long_candidate_request_ends_at_the_pass_after_its_deadline_and_a_retrieve_runs_meanwhile(engine, rng):
    """The issue's case on the tiny model: twelve candidates as long as one pass holds, a 2 s deadline that passes
    mid-scoring. By padded tokens all twelve shared one pass (about twelve budgets); now each pass holds one, the
    small retrieve behind it is served between them, and the request ends at the step after its deadline."""
    family = engine.family
    clock = ManualClock()
    scheduler = Scheduler(engine.family, engine.runner, SchedulerConfig(prefix_cache_bytes=0), clock)
    request = long_score(engine, rng, family.max_candidate_len)
    assert 12 * family.max_candidate_len <= family.score_max_tokens  # what the padded-token bound let into one pass
    big = scheduler.submit(engine.prepare(request), timeout_s=2)
    small = scheduler.submit(
        engine.prepare(RetrieveRequest(prompt_token_ids=random_prompt(engine, 9, rng), beam_width=3)), timeout_s=2
    )
    (job,) = [j for j in scheduler.inbox if j.future is big]
    passes = []
    while not small.done():
        done = job.rows_done
        scheduler.step()
        passes.append(job.rows_done - done)
    assert len(small.result().items) == 3 and not big.done() and job.state is JobState.SCORING
    width, context = family.max_candidate_len, job.ctx.length
    for rows in filter(None, passes):
        assert rows == 1 or family.cost.rows(rows, width, rows * context) <= family.score_max_tokens
    assert 0 < job.rows_done < 12
    clock.advance(2.05)  # past its deadline, mid-scoring
    scheduler.step()
    with pytest.raises(RequestTimeout):
        big.result(timeout=0)
    assert scheduler.idle and scheduler.budget.reserved == 0


def test_a_deadline_that_passes_during_the_prefill_pass_ends_the_request_before_its_rows_pass(engine, rng, monkeypatch):
    clock = ManualClock()
    scheduler = Scheduler(engine.family, engine.runner, SchedulerConfig(prefix_cache_bytes=0), clock)
    runner, rows_passes = engine.runner, []
    prefill, rows_pass = runner.prefill, runner.rows_pass

    def slow_prefill(chunks):  # the pass takes 3 s of the scheduler's clock
        out = prefill(chunks)
        clock.advance(3)
        return out

    monkeypatch.setattr(runner, "prefill", slow_prefill)
    monkeypatch.setattr(runner, "rows_pass", lambda jobs, budget: (rows_passes.append(jobs), rows_pass(jobs, budget)))
    request = ScoreRequest(
        prompt_token_ids=random_prompt(engine, 12, rng), candidates=[Candidate(item_id="item-000004")]
    )
    future = scheduler.submit(engine.prepare(request), timeout_s=1)
    scheduler.step()  # prefill (3 s), then the deadline is checked before the rows pass
    with pytest.raises(RequestTimeout):
        future.result(timeout=0)
    assert rows_passes == [] and scheduler.idle and scheduler.budget.reserved == 0


def test_a_deadline_that_passes_during_a_decode_pass_ends_a_scoring_request_before_its_next_pass(
    tiny_dir, rng, monkeypatch
):
    from genrec.engine import Engine

    engine = Engine.from_pretrained(tiny_dir, score_max_tokens=64, scheduler=SchedulerConfig(prefix_cache_bytes=0))
    clock = ManualClock()
    scheduler = Scheduler(engine.family, engine.runner, SchedulerConfig(prefix_cache_bytes=0), clock)
    scoring = scheduler.submit(engine.prepare(long_score(engine, rng, 30, n=10)), timeout_s=5)
    retrieve = engine.prepare(RetrieveRequest(prompt_token_ids=random_prompt(engine, 9, rng), beam_width=3))
    decoding = scheduler.submit(retrieve, timeout_s=100)
    scheduler.step()  # both prefilled; the score request's first pass
    (job,) = scheduler.in_state(JobState.SCORING)
    assert job.rows_done == 1 and scheduler.in_state(JobState.DECODING)
    decode = engine.runner.decode

    def slow_decode(cohorts, *args, **kwargs):  # a decode pass that takes 10 s of the scheduler's clock
        decode(cohorts, *args, **kwargs)
        clock.advance(10)

    monkeypatch.setattr(engine.runner, "decode", slow_decode)
    scheduler.step()
    with pytest.raises(RequestTimeout):
        scoring.result(timeout=0)
    assert job.rows_done == 1  # ended before another rows pass; the retrieve goes on
    run(scheduler)
    assert len(decoding.result().items) == 3


def test_a_long_prompt_prefills_in_chunks_bounded_by_their_cost(engine, rng, monkeypatch):
    budget = 64
    scheduler = Scheduler(
        engine.family, engine.runner, SchedulerConfig(prefill_tokens_per_step=budget, prefix_cache_bytes=0)
    )
    steps, prefill = [], engine.runner.prefill
    monkeypatch.setattr(
        engine.runner, "prefill", lambda chunks: (steps.append([(s, n) for *_, s, n in chunks]), prefill(chunks))[1]
    )
    short = RetrieveRequest(prompt_token_ids=random_prompt(engine, budget, rng), beam_width=2)
    scheduler.submit(engine.prepare(short))
    run(scheduler)
    assert steps == [[(0, budget)]]  # a prompt within the budget: one chunk, as by tokens alone
    steps.clear()
    long = RetrieveRequest(prompt_token_ids=random_prompt(engine, 1500, rng), beam_width=2)
    future = scheduler.submit(engine.prepare(long))
    run(scheduler)
    cost, most = engine.family.cost, engine.family.cost.prefill(0, budget)
    assert all(sum(cost.prefill(s, n) for s, n in step) <= most for step in steps)
    assert sum(n for step in steps for _, n in step) == 1500 and steps[-1][-1][1] < budget / 2  # deep chunks shorter
    (alone,) = engine.retrieve([long])
    assert [i.item_id for i in future.result().items] == [i.item_id for i in alone.items]


def test_ranking_rows_over_a_long_history_take_passes_bounded_by_their_cost_and_rank_the_same(
    hstu_dir, ranker, monkeypatch
):
    from genrec.engine import Engine

    rnd = random.Random(6)
    items = [f"item-{i:06d}" for i in range(100)]
    request = RankRequest(
        history=[Event(item_id=rnd.choice(items), action=1) for _ in range(300)], candidates=rnd.sample(items, 30)
    )
    small = Engine.from_pretrained(hstu_dir, score_max_tokens=50, scheduler=SchedulerConfig(prefix_cache_bytes=0))
    passes, rows_pass = [], small.runner.rows_pass

    def counted(jobs, budget):
        (job,) = jobs
        done = job.rows_done
        rows_pass(jobs, budget)
        passes.append(job.rows_done - done)

    monkeypatch.setattr(small.runner, "rows_pass", counted)
    (got,) = small.rank([request])
    each = small.family.cost.rows(1, 1, 300)  # one row over the 300 events
    assert each > 2 and sum(passes) == 30 and max(passes) * each <= 50 < (max(passes) + 1) * each
    (alone,) = ranker.rank([request])
    for mine, theirs in zip(got.items, alone.items, strict=True):
        assert mine.item_id == theirs.item_id and mine.scores == pytest.approx(theirs.scores, abs=1e-6)


# -- one candidate's length ----------------------------------------------------------------------------------


def test_a_candidate_longer_than_one_pass_holds_is_refused_naming_it(engine, rng):
    family = engine.family
    longest = family.max_candidate_len
    assert longest == max(family.cost.longest_row(family.score_max_tokens), family.levels)  # the default
    prompt = random_prompt(engine, 10, rng)
    fits = Candidate(token_ids=random_prompt(engine, longest, rng))
    over = Candidate(token_ids=random_prompt(engine, longest + 1, rng))
    with pytest.raises(InvalidRequestError, match=f"{longest + 1} tokens exceed .* limit of {longest} tokens per") as e:
        engine.score([ScoreRequest(prompt_token_ids=prompt, candidates=[fits, over])])
    assert e.value.field == "candidates[1]"
    (scored,) = engine.score([ScoreRequest(prompt_token_ids=prompt, candidates=[fits])])
    assert len(scored.scores) == 1


def test_a_candidate_text_beyond_the_cap_is_refused_untokenized(engine, monkeypatch):
    spy = LongestText(engine.family.tokenizer)
    monkeypatch.setattr(engine.family, "tokenizer", spy)
    text = "news " * (engine.family.max_candidate_len * 13)  # within the model's positions' bound, not the cap's
    with pytest.raises(InvalidRequestError, match="refused untokenized") as e:
        engine.score(
            [ScoreRequest(prompt="user listened", candidates=[Candidate(item_id="item-000001"), Candidate(text=text)])]
        )
    assert e.value.field == "candidates[1].text" and spy.longest < 1000


def test_the_cap_is_a_setting_checked_by_name(tiny_dir, rng):
    from genrec.engine import Engine

    capped = Engine.from_pretrained(tiny_dir, max_candidate_len=4)
    prompt = random_prompt(capped, 10, rng)
    with pytest.raises(InvalidRequestError, match="5 tokens exceed this engine's limit of 4") as e:
        capped.score([ScoreRequest(prompt_token_ids=prompt, candidates=[Candidate(token_ids=[7] * 5)])])
    assert e.value.field == "candidates[0]"
    (ok,) = capped.score([ScoreRequest(prompt_token_ids=prompt, candidates=[Candidate(item_id="item-000002")])])
    assert len(ok.scores) == 1
    assert capped.family.describe()["max_candidate_len"] == 4  # what /v1/model tells clients
    for bad in (0, True, 2.5):
        with pytest.raises(InvalidRequestError, match="max_candidate_len"):
            Engine.from_pretrained(tiny_dir, max_candidate_len=bad)


# -- the benchmark -------------------------------------------------------------------------------------------


def test_bench_deadline_reports_the_pass_shapes_the_text_refusal_and_the_issue_case(tiny_dir, tmp_path):
    import json

    from typer.testing import CliRunner

    from genrec.cli import app

    out = tmp_path / "deadline.json"
    args = ["--model", str(tiny_dir), "--candidates", "3", "--candidate-len", "100", "--words", "1000"]
    result = CliRunner().invoke(
        app, ["bench", "deadline", *args, "--deadline-s", "0.5", "--repeats", "1", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    shapes = report["passes"]["shapes"]
    assert [s["shape"] for s in shapes][-1] == "longest_row" and shapes[-1]["rows"] == 1
    assert all(s["token_equivalents"] <= report["engine"]["score_max_tokens"] or s["rows"] == 1 for s in shapes)
    assert report["text_candidates"]["refused"] and "tokens per candidate" in report["text_candidates"]["error"]
    (run,) = report["issue_case"]["runs"]
    assert run["score_status"] in ("ok", "RequestTimeout") and run["retrieve_s"] > 0
