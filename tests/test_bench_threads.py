"""`genrec bench threads`'s own parts: the background load ends with its block, and the figures are medians over
rounds set against the right baseline."""

import os

import pytest

from genrec_bench.load import BackgroundLoad, Setting, ratios, settings_for, summarize


def test_the_background_load_runs_during_the_block_and_ends_with_it():
    with BackgroundLoad(2) as load:
        pids = [p.pid for p in load.processes]
        assert len(pids) == 2 and all(p.poll() is None for p in load.processes)
    assert all(p.poll() is not None for p in load.processes)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_settings_pair_each_thread_count_pinned_and_unpinned():
    names = [s.name for s in settings_for(2)]
    assert names == ["1 thread", "1 thread, pinned", "2 threads", "2 threads, pinned", "2 threads, bound per thread"]
    assert [s.name for s in settings_for(1)] == ["1 thread", "1 thread, pinned"]


def _round(sequential, saturation, p99, cores=None):
    return {"sequential_s": sequential, "saturation_qps": saturation, "p50_s": p99 / 2, "p99_s": p99,
            "pinned_cores": cores, "load_average_1m_mean": 4.0, "runnable_threads_mean": None}  # fmt: skip


def test_figures_are_medians_over_rounds_and_ratios_name_their_baseline():
    runs = {
        "1 thread": [_round(0.4, 2.0, 1.0), _round(0.2, 4.0, 0.6), _round(0.3, 3.0, 0.8)],
        "1 thread, pinned": [_round(0.6, 1.5, 1.2, [0]), _round(0.6, 1.5, 1.2, [0]), _round(0.6, 1.5, 1.2, [0])],
        "2 threads": [_round(0.5, 2.0, 2.0)] * 3,
    }
    summary = summarize(runs)
    assert summary["1 thread"]["sequential_s"] == 0.3 and summary["1 thread"]["saturation_qps"] == 3.0
    assert summary["1 thread"]["runnable_threads_mean"] is None
    assert summary["1 thread, pinned"]["pinned_cores"] == [[0]] * 3  # each round's
    settings = [Setting("1 thread", 1), Setting("1 thread, pinned", 1, pin=True), Setting("2 threads", 2)]
    result = ratios(summary, settings, default="2 threads")
    pinned = result["1 thread, pinned"]["vs_unpinned"]
    assert pinned["baseline"] == "1 thread" and pinned["sequential_s"] == pytest.approx(2.0)
    assert pinned["saturation_qps"] == pytest.approx(0.5) and pinned["p99_s"] == pytest.approx(1.5)
    assert "vs_unpinned" not in result["1 thread"] and result["2 threads"] == {}  # the default, against nothing
    assert result["1 thread"]["vs_torch_default"]["sequential_s"] == pytest.approx(0.6)
