"""`genrec bench soak`'s report: growth over the second half per 1,000 requests, and the plateau verdict."""

from __future__ import annotations

import os

import pytest

from genrec.bench.soak import rss_mb, slope_per_1k, summarize


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
