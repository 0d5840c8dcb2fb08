"""`genrec bench soak`'s report: growth over the second half per 1,000 requests, and the plateau verdict."""

from __future__ import annotations

import os

import pytest

from genrec_bench.soak import rss_mb, slope_per_1k, slopes_by_third, steady_state, summarize


def _samples(values_by_process: dict[str, list[float]], per_burst: int = 100) -> list[dict]:
    bursts = len(next(iter(values_by_process.values())))
    return [
        {
            "burst": n,
            "requests": n * per_burst,
            "seconds": 1.0,
            "rss_mb": {name: values[n] for name, values in values_by_process.items()},
            "by_kind": {"retrieve_tokens:200": per_burst} if n else {},
        }
        for n in range(bursts)
    ]


def test_slope_is_mb_per_thousand_requests():
    assert slope_per_1k([0, 1000, 2000], [100.0, 105.0, 110.0]) == pytest.approx(5.0)
    assert slope_per_1k([1000], [1.0]) is None


def test_growth_that_stops_plateaus_and_steady_growth_does_not():
    flat_after_warmup = [300.0, 350.0, 360.0] + [361.0] * 9  # warm-up growth, then flat
    leaking = [300.0 + 2.0 * n for n in range(12)]  # 2 MB per burst of 100: 20 MB per 1,000 requests
    report = summarize(_samples({"engine": flat_after_warmup, "ingress": leaking}), plateau_mb_per_1k=1.0)
    assert report["processes"]["engine"]["plateaued"]
    assert not report["processes"]["ingress"]["plateaued"]
    assert report["processes"]["ingress"]["second_half_mb_per_1k_requests"] == pytest.approx(20.0)
    assert not report["plateaued"]
    assert report["requests"] == 1100 and report["answers"] == {"retrieve_tokens:200": 1100}


def test_rss_of_a_live_and_a_gone_process():
    read = rss_mb({"me": os.getpid(), "gone": 2**22 + 12345})
    assert read["me"] > 1 and read["gone"] is None


def test_steady_state_tells_a_flattening_curve_from_a_straight_line():
    bursts = 31
    flattening = [400.0 + 30.0 * (1 - 0.85**n) for n in range(bursts)]  # fragmentation settling: slows down
    straight = [400.0 + 0.3 * n for n in range(bursts)]  # 3 MB per 1,000 requests, to the end: a leak
    flat = [400.0, 450.0] + [451.0] * (bursts - 2)
    report = summarize(_samples({"a": flattening, "b": straight, "c": flat}), plateau_mb_per_1k=1.0)
    assert report["steady_state"] == {"a": "steady", "b": "growing", "c": "steady"}
    first, middle, last = report["processes"]["b"]["thirds_mb_per_1k_requests"]
    assert first == pytest.approx(3.0) and last == pytest.approx(3.0)
    slowing = [400.0 + 60.0 * (1 - 0.95**n) for n in range(bursts)]  # still growing at the end, but slower
    assert summarize(_samples({"a": slowing}), plateau_mb_per_1k=1.0)["steady_state"] == {"a": "slowing"}


def test_steady_state_needs_six_bursts():
    assert slopes_by_third([(100 * n, 1.0) for n in range(1, 6)]) == []
    assert steady_state([], 1.0) == "too_short"
    assert summarize(_samples({"a": [1.0, 2.0, 3.0]}), plateau_mb_per_1k=1.0)["steady_state"] == {"a": "too_short"}
