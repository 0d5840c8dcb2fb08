"""Event times (issue #29, item 2): a timestamp beyond ±MAX_TIMESTAMP_S (a JSON integer beyond a float included)
is refused naming `history[i].timestamp`, in the API model and in both HTTP bodies that carry a history; the
model's gap buckets are total (no input raises), equal the plain formula on every valid pair, and no valid
history makes the ranker raise or answer a non-finite probability."""

import json
import math
import random

import numpy as np
import pytest
from pydantic import ValidationError

from genrec.api import MAX_TIMESTAMP_S, Event, RankRequest
from genrec.model.config import MAX_GAP_S
from genrec.serving.http_errors import _invalid
from genrec.serving.schemas import RankBody, RecommendBody
from tests.conftest import HSTU_TINY as SPEC

HUGE = "9" * 400  # a JSON integer no float holds
# Refused timestamps, as JSON text: beyond a float, finite ones whose gap overflows a float, just past the bound,
# epoch milliseconds, and the non-finite ones Python's json writes.
REFUSED = [HUGE, f"-{HUGE}", "1.7e308", "-1.7e308", "1000000000001", "1.0000000000001e12", "1.7e12", "NaN", "Infinity"]


def item(i: int) -> str:
    return f"item-{i % SPEC.items:06d}"


def history_json(times: list[str]) -> str:
    return "[" + ", ".join(f'{{"item_id": "{item(k)}", "timestamp": {t}}}' for k, t in enumerate(times)) + "]"


@pytest.mark.parametrize("bad", REFUSED)
@pytest.mark.parametrize("body", ["rank", "recommend"])
def test_a_time_beyond_the_bound_is_refused_naming_the_field(body, bad):
    """The bodies of /v1/rank and the two-stage /v1/recommend, parsed as FastAPI does (json.loads, then the
    model), give the 422 body that names `history[1].timestamp`."""
    history = history_json(["1.7e9", bad])
    text = {
        "rank": f'{{"history": {history}, "candidates": ["{item(3)}"]}}',
        "recommend": f'{{"prompt": "p", "beam_width": 4, "history": {history}}}',
    }[body]
    model = RankBody if body == "rank" else RecommendBody
    for parse in (lambda: model.model_validate(json.loads(text)), lambda: model.model_validate_json(text)):
        with pytest.raises(ValidationError) as refused:
            parse()
        error = _invalid(refused.value.errors())
        assert [d.field for d in error.details] == ["history[1].timestamp"], error
        assert "timestamp" in error.details[0].message


def test_the_bound_itself_and_every_number_within_it_are_accepted():
    for t in (MAX_TIMESTAMP_S, -MAX_TIMESTAMP_S, 10**12, -(10**12), 0, -0.0, 5e-324, 1.7e9, np.float64(1e12)):
        assert Event(item_id="a", timestamp=t).timestamp == t
    assert Event(item_id="a").timestamp is None
    request = RankRequest.model_validate_json(f'{{"history": {history_json(["1e12", "-1e12"])}, "candidates": ["x"]}}')
    assert [e.timestamp for e in request.history] == [1e12, -1e12]


def plain_buckets(config, timestamps) -> list[int]:
    """The gap-bucket formula written plainly, for valid times (where nothing can overflow)."""
    out, previous = [], None
    for t in timestamps:
        if t is None or previous is None:
            out.append(config.num_time_buckets)
        else:
            out.append(min(int(math.log2(1.0 + max(float(t) - float(previous), 0.0))), config.num_time_buckets - 1))
        previous = t
    return out


def extreme_time(rng: random.Random):
    """A valid event time, mostly at the edges: the bound, its neighbours, zero, tiny and huge gaps, ints."""
    edge = rng.choice([MAX_TIMESTAMP_S, math.nextafter(MAX_TIMESTAMP_S, 0), 10**12, 1.0, 5e-324, 0.0, 1.7e9])
    return rng.choice(
        [
            None,
            edge,
            -edge,
            rng.uniform(-MAX_TIMESTAMP_S, MAX_TIMESTAMP_S),
            rng.randint(-(10**12), 10**12),
            1.7e9 + rng.choice([0.0, 1e-6, 1.0, 2.0**38]),
        ]
    )


@pytest.mark.parametrize("buckets", [1, 6, 41, 64])
def test_gap_buckets_equal_the_plain_formula_on_random_valid_times(ranker, buckets):
    from dataclasses import replace

    config = replace(ranker.model.config, num_time_buckets=buckets)
    rng = random.Random(buckets)
    for _ in range(300):
        times = [extreme_time(rng) for _ in range(rng.randint(1, 12))]
        got = config.time_buckets(times)
        assert got == plain_buckets(config, times), times
        assert all(0 <= b <= config.unknown_bucket for b in got)
        cut = rng.randint(0, len(times) - 1)  # appending after a cached prefix gives the same buckets
        assert got[:cut] + config.time_buckets(times[cut:], previous=times[cut - 1] if cut else None) == got
    # The widest valid gap is the clamp: its bucket is the largest a valid history can get.
    widest = min(int(math.log2(1 + MAX_GAP_S)), buckets - 1)
    assert config.time_buckets([-MAX_TIMESTAMP_S, MAX_TIMESTAMP_S])[1] == widest


def test_gap_buckets_never_raise_whatever_they_are_given(ranker):
    """What the API refuses can still reach the model from Python (a RankRequest.model_construct, a training
    script): such a time counts as missing, and no gap overflows."""
    config = ranker.model.config
    unknown = config.unknown_bucket
    assert config.time_buckets([10**400, 1.0, -(10**400)]) == [unknown, unknown, unknown]
    assert config.time_buckets([1.7e308, -1.7e308, math.inf, math.nan, 5.0]) == [unknown] * 5
    assert config.time_buckets([1.0, 3.0], previous=10**400) == [unknown, 1]
    assert config.time_buckets([np.int64(10), np.float32(12.0), True, "noon"]) == [unknown, 1, unknown, unknown]


def test_no_valid_history_makes_the_ranker_raise(ranker):
    rng = random.Random(29)
    requests = []
    for _ in range(40):
        events = [
            Event(item_id=item(rng.randrange(SPEC.items)), action=rng.choice([None, 0, 2]), timestamp=extreme_time(rng))
            for _ in range(rng.randint(1, 30))
        ]
        requests.append(RankRequest(history=events, candidates=[item(rng.randrange(SPEC.items)) for _ in range(3)]))
    results = ranker.rank(requests)  # raises on any failure
    probs = np.array([[s for i in r.items for s in i.scores.values()] for r in results])
    assert np.isfinite(probs).all() and ((probs >= 0) & (probs <= 1)).all()
    # Each alone gives the same: the extreme times change no row's neighbours.
    for request, batched in zip(requests[:5], results[:5], strict=True):
        (alone,) = ranker.rank([request])
        flat = lambda result: [p for i in result.items for p in i.scores.values()]  # noqa: E731
        assert flat(alone) == pytest.approx(flat(batched), abs=1e-6)
