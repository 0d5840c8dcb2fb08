"""The benchmark commands run end to end on a tiny model and report sane JSON (not timed: smoke only)."""

import json

import pytest
from typer.testing import CliRunner

from genrec.cli import app


def run(tmp_path, *args):
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["bench", *args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_bench_retrieve(tiny_dir, tmp_path):
    report = run(
        tmp_path, "retrieve", "--model", str(tiny_dir), "--prompt-len", "20", "--beam-width", "4",
        "--repeats", "1", "--user-embedding",
    )  # fmt: skip
    assert report["ratios"]["retrieve_over_prefill"] > 0 and report["ratios"]["hf_over_retrieve"] > 0
    assert report["hf_top_beam_agreement"] == 1.0
    assert report["ratios"]["soft_token_over_token_only"] > 0


def test_bench_retrieve_times_a_prefix_cache_miss(tiny_dir, tmp_path):
    report = run(
        tmp_path, "retrieve", "--model", str(tiny_dir), "--prompt-len", "40", "--beam-width", "4", "--repeats", "2",
        "--no-hf-baseline", "--prefix-cache",
    )  # fmt: skip
    assert report["seconds"]["genrec_retrieve_cache_miss"] > 0 and report["ratios"]["cache_miss_over_cache_off"] > 0


def test_bench_retrieve_times_a_per_level_schedule(tiny_dir, tmp_path):
    report = run(
        tmp_path, "retrieve", "--model", str(tiny_dir), "--prompt-len", "20", "--beam-width", "16", "--repeats", "1",
        "--no-hf-baseline", "--beam-widths", "2,8,16",
    )  # fmt: skip
    assert report["beam_widths"] == [2, 8, 16] and report["ratios"]["scheduled_over_constant"] > 0
    assert 0 < report["scheduled_overlap"] <= 1


def test_bench_isolation(tmp_path):
    report = run(
        tmp_path, "isolation", "--prompt-len", "48", "--beam-width", "4", "--events", "48", "--candidates", "2",
        "--guesses", "4", "--calibration", "1",
    )  # fmt: skip
    for family in ("retriever", "ranker"):
        modes = [report[family][m] for m in ("own_scope", "no_scope", "victims_scope")]
        assert all(0 <= m["accuracy"] <= 1 and m["wrong_guess_median_s"] > 0 for m in modes)
        assert all(m["calibration"]["cold_over_warm"] > 0 and m["threshold_s"] > 0 for m in modes)
    assert report["cross_user_accuracy_max"] <= 1 and report["goals"]


def test_bench_score(tiny_dir, tmp_path):
    report = run(
        tmp_path, "score", "--model", str(tiny_dir), "--prefix-len", "20", "--candidates", "10",
        "--repeats", "1", "--fanout-sample", "3",
    )  # fmt: skip
    assert report["fanout_measured_candidates"] == 3 and report["ratios"]["fanout_over_genrec"] > 0


def test_bench_load(tiny_dir, tmp_path):
    plot = tmp_path / "load.png"
    report = run(
        tmp_path, "load", "--model", str(tiny_dir), "--prompt-len", "16", "--beam-width", "4", "--rates", "20",
        "--duration", "0.5", "--burst", "4", "--plot", str(plot),
    )  # fmt: skip
    (point,) = report["rates"]
    assert point["errors"] == 0 and point["completed"] == point["sent"] > 0
    assert report["saturation"]["requests"] == 4 and plot.stat().st_size > 0


def test_bench_returning(tiny_dir, tmp_path):
    report = run(
        tmp_path, "returning", "--model", str(tiny_dir), "--events", "60", "--users", "3", "--burst", "4",
        "--rate", "4", "--duration", "0.5", "--repeats", "2",
    )  # fmt: skip
    runs = report["workload"]
    assert runs["stable_cache_off"]["reuse_rate"] == 0 and runs["stable_cache_on"]["reuse_rate"] > 0.3
    assert runs["sliding_cache_on"]["reuse_rate"] < runs["stable_cache_on"]["reuse_rate"]
    assert report["ratios"]["returning_cold_over_warm"] > 0
    admission = report["admission"]
    assert 0 <= admission["plain_lru"]["reuse_rate"] <= 1 and admission["segmented_lru"]["evictions"] >= 0


def test_bench_rank(tmp_path):
    hstu_dir = tmp_path / "hstu"
    assert CliRunner().invoke(app, ["tiny-model", str(hstu_dir), "--family", "hstu", "--items", "50"]).exit_code == 0
    report = run(
        tmp_path, "rank", "--model", str(hstu_dir), "--events", "30", "--candidates", "8", "--repeats", "1",
        "--fanout-sample", "2", "--new-events", "3",
    )  # fmt: skip
    assert report["fanout_timed"] == 2 and all(v > 0 for v in report["ratios"].values())


def test_bench_cache(ray_cluster, redis_url, tmp_path):
    report = run(
        tmp_path, "cache", "--keys", "5000", "--dim", "8", "--batch", "100", "--batches", "5", "--redis-url", redis_url,
    )  # fmt: skip
    rates = report["get_keys_per_s"]
    assert all(v > 0 for v in rates.values())
    assert 0 < report["hit_rate_at_10pct_capacity"]["lru"] <= 1


@pytest.mark.integration  # its own local Ray and Serve, in a subprocess
def test_bench_serve(tiny_dir, tmp_path):
    """Through the real CLI in a process of its own (it starts its own local Ray and Serve, then stops them)."""
    import os
    import subprocess
    import sys

    out, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    args = ["--model", str(tiny_dir), "--prompt-len", "16", "--beam-width", "4", "--rates", "10", "--duration", "0.5"]
    command = [sys.executable, "-m", "genrec.cli", "bench", "serve", *args, "--burst", "4", "--pairs", "3"]
    env = os.environ | {"RAY_AUTH_MODE": "disabled"}
    command += ["--json", str(out), "--plot", str(plot)]
    done = subprocess.run(command, env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    report = json.loads(out.read_text())
    assert report["ratios"]["saturation_serve_over_in_process"] > 0 and report["one_at_a_time"]["pairs"] == 3
    hops = report["one_at_a_time"]
    assert hops["in_process_median_ms"] > 0 and hops["handle_median_ms"] > 0 and "proxy_and_ingress_added_ms" in hops
    assert report["serve"]["rates"][0]["completed"] > 0 and report["serve"]["rates"][0]["errors"] == 0
    assert plot.stat().st_size > 0


@pytest.mark.integration  # five engine processes, one per thread setting
def test_bench_threads(tiny_dir, tmp_path):
    report = run(
        tmp_path, "threads", "--model", str(tiny_dir), "--background", "0", "--rounds", "1", "--settle-s", "0",
        "--duration", "0.3", "--burst", "2", "--prompt-len", "16", "--beam-width", "4", "--rate", "20",
    )  # fmt: skip  # no spinning background here: it would take a core from the suite (test_bench_threads.py has it)
    names = set(report["settings"])
    assert {"1 thread", "1 thread, pinned"} <= names and report["background_processes"] == 0
    for name, figures in report["settings"].items():
        assert figures["rounds"] == 1 and figures["saturation_qps"] > 0 and figures["sequential_s"] > 0, name
        assert (figures["pinned_cores"] is not None) == ("pinned" in name), name
    assert report["ratios"]["1 thread, pinned"]["vs_unpinned"]["baseline"] == "1 thread"


def test_bench_sid_catalog(tmp_path):
    report = run(
        tmp_path, "sid-catalog", "--items", "3000", "--per-level", "64", "--small-per-level", "8", "--prompt-len", "16",
        "--beam-width", "8", "--repeats", "1", "--build-repeats", "1",
    )  # fmt: skip
    assert report["codes"]["large"] > report["codes"]["small"] > 8**2
    assert report["trie_build_s"] > 0 and report["ratios"]["retrieve_large_over_small"] > 0
    assert isinstance(report["meets_goals"], bool)


def test_bench_filter(tmp_path):
    report = run(
        tmp_path, "filter", "--items", "3000", "--per-level", "64", "--prompt-len", "16", "--beam-width", "8",
        "--repeats", "1",
    )  # fmt: skip
    assert report["all_returned_allowed"] and 0 < report["allowed_share"] < 0.3
    assert report["ratios"]["cold_over_unfiltered"] > 0 and report["ratios"]["cached_over_unfiltered"] > 0
    assert isinstance(report["meets_goals"], bool)


def test_bench_catalog_reload(tmp_path):
    report = run(
        tmp_path, "catalog-reload", "--items", "3000", "--per-level", "64", "--prompt-len", "16", "--beam-width", "8",
        "--clients", "2", "--warmup-s", "0.5", "--window-s", "1.5",
    )  # fmt: skip
    assert report["failed"] == 0 and report["requests"] > 0
    versions = report["versions_answered"]
    assert [len(v) for v in versions.values()] == [1, 1, 1]
    assert versions["before"] == versions["after_rollback"] != versions["after_reload"]
    assert report["reload"]["seconds"] > 0 and report["rollback"]["seconds"] < report["reload"]["seconds"] * 10
    assert isinstance(report["meets_goals"], bool)


def test_bench_kernels(tiny_dir, tmp_path):
    report = run(tmp_path, "kernels", "--model", str(tiny_dir), "--prompt-len", "24", "--requests", "2")
    per_layer = report["per_layer"]
    assert per_layer["fused"] == per_layer["unfused"]  # the CPU runs the plain pieces whatever the switch
    assert 0 < per_layer["unfused"]["decode"] < 60 and 0 < per_layer["unfused"]["prefill"] < 60
    assert report["ratios"]["decode_fused_over_unfused"] == 1.0 and report["prefill_logits_max_diff"] == 0.0
    assert 0 < per_layer["fused"]["hstu_prefill"] and 0 < per_layer["fused"]["hstu_candidates"]
