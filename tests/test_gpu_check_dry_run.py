"""The GPU check dry-run on the CPU, as CI can: `python -m genrec_bench.gpu_check --device cpu --preset tiny` runs
every part with the CPU plan at tiny sizes and writes each part's JSON; only the CUDA kernels' part is skipped. So a
GPU session (rare, 15 minutes) never meets a part that fails for a reason a CPU could have shown. Also the order of
the parts, full and --quick, without running them."""

import json
import os
import subprocess
import sys
import time

import pytest

from genrec_bench.gpu_check import ENGINE_OPTIONS, QUICK_ENGINES, RECOMPILE_LIMIT, Report, arguments, steps

pytestmark = pytest.mark.slow  # make test runs it; make test-fast skips it

CONTEXTS = (64, 128)
CUDA_ONLY = {"kernels", "attention choice"}  # the parts that need CUDA: "skipped": "no CUDA" on a CPU, never an error


def order(*argv: str) -> list[str]:
    args = arguments(["--device", "cpu", "--preset", "tiny", "--contexts", "64,128", *argv])
    return [name for name, _, skip in steps(args, Report.__new__(Report), {}) if skip != "note"]


def test_the_profiles_run_before_the_timings_and_the_preset_before_other_models():
    names = order()
    assert names[:4] == ["versions", "kernels", "attention choice", "load tiny"]
    profiles = [i for i, n in enumerate(names) if n.startswith(("launches", "where the time goes"))]
    timings = [i for i, n in enumerate(names) if n.startswith("sid-gr")]
    assert len(profiles) == 1 + 2 * len(CONTEXTS) + 2 and max(profiles) < names.index("judged tiny 256/3") < min(
        timings
    )
    assert "where the time goes 128/256/3 split-KV off" in names
    assert names[-3:] == ["judged tiny qwen3", "judged tiny qwen2", "hstu 200/50"]


def test_quick_keeps_versions_kernels_correctness_and_one_request_timed():
    assert order("--quick") == [
        "versions",
        "kernels",
        "attention choice",
        "load tiny",
        "judged tiny 256/3",
        "sid-gr 64/256/3",
        "sid-gr 128/256/3",
        "judged tiny qwen3",
        "judged tiny qwen2",
    ]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    out = tmp / "gpu_check.json"
    command = [sys.executable, "-m", "genrec_bench.gpu_check", "--device", "cpu", "--preset", "tiny"]
    command += ["--contexts", ",".join(map(str, CONTEXTS)), "--out", str(out), "--budget-s", "600"]
    # The presets written afresh, nowhere shared; one torch thread: on 2 shared cores OpenMP's spinning threads made
    # the same run take 27 s or 184 s (a dry run checks the parts, not their speed).
    env = {**os.environ, "GENREC_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    wall_s = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-3000:]
    print(f"gpu_check dry run: {wall_s:.1f} s")
    return json.loads(out.read_text())


def test_every_part_runs_on_the_cpu(dry_run):
    parts = {name: dry_run[name] for name in dry_run["run"]["order"]}
    assert list(parts) == order()
    assert all(dry_run[name] == {"skipped": "no CUDA"} for name in CUDA_ONLY)
    failed = {name: part for name, part in parts.items() if name not in CUDA_ONLY and set(part) & {"error", "skipped"}}
    assert not failed, json.dumps(failed, indent=1)[:3000]
    assert set(dry_run["seconds"]) == set(parts) - CUDA_ONLY
    compile_ = dry_run["run"]["compile"]
    assert compile_["now"] >= RECOMPILE_LIMIT and compile_["setting"].startswith("torch._dynamo.config.")
    for name in ("released tiny", "released tiny qwen3", "released tiny qwen2"):
        assert dry_run["run"][name]["dynamo_reset"] is True


def test_the_engines_started_with_their_plans_and_memory(dry_run):
    load = dry_run["load tiny"]
    assert load["engines"] == list(ENGINE_OPTIONS) and set(QUICK_ENGINES) <= set(load["engines"])
    for name, started in load["started"].items():
        assert {"plan", "start_s", "warmup_s", "graph_bytes", "gpu_memory_gib", "compiled_fallbacks"} <= set(started)
        assert started["plan"]["split_kv"] == ("off" if name == "fast_whole" else "auto")
        assert not started["plan"]["compiled_pieces"]  # the CPU plan
    assert "gpu_memory_after_start" in load and load["fast_second_request_s"] > 0


def test_the_profiles_count_each_mode_and_split_kv_off(dry_run):
    (launches,) = [part for name, part in dry_run.items() if name.startswith("launches per decode pass")]
    for mode in ("eager", "varlen", "graphs", "graphs_split_off", "graphs_selecting"):
        assert {"kernels", "launch_calls", "launch_calls_by_call", "graph_launches", "split"} <= set(launches[mode])
        if mode != "eager":  # on the CPU every mode is the same computation
            assert all(launches[f"{mode}_items_equal_eager"]) and launches[f"{mode}_max_score_diff"] == 0
    for n in CONTEXTS:
        assert dry_run[f"where the time goes {n}/256/3"]["plan"]["split_kv"] == "auto"
        whole = dry_run[f"where the time goes {n}/256/3 split-KV off"]
        assert whole["plan"]["split_kv"] == "off" and {"wall_ms", "kernel_ms_by_kind", "launch_calls"} <= set(whole)
    for workload in ("batch_8", "callers_4"):  # the gaps to SID-GR at the longest context, by profile
        part = dry_run[f"where the time goes {CONTEXTS[-1]}/256/3 {workload}"]
        assert part["workload"] == workload and part["wall_ms"] > 0 and "gpu_idle_ms" in part


def test_correctness_and_the_timed_arms(dry_run):
    judged = dry_run["judged tiny 256/3"]
    assert judged["ok"] and {"fast", "fast_whole", "eager", "fast_selecting", "fast_fp8"} <= set(
        judged[str(CONTEXTS[0])]
    )
    for architecture in ("qwen3", "qwen2"):
        part = dry_run[f"judged tiny {architecture}"]
        assert part["ok"] and not part["plans"]["float32"]["compiled_pieces"]
    for n in CONTEXTS:
        timed = dry_run[f"sid-gr {n}/256/3"]
        assert timed["repeats"] == 1  # a CPU dry run
        arms = {"fast", "fast_whole", "fast_selecting", "fast_fp8", "eager"}
        assert arms | {"one_prefill"} == set(timed["one_request_s"])
        assert arms | {"one_prefill_each"} == set(timed["batch_8_s"])
        assert {"fast", "fast_whole", "eager"} == set(timed["concurrent_4"])
        assert {
            "one_whole_over_split",
            "batch_whole_over_split",
            "concurrent_split_over_whole_rate",
            "one_fp8_over_fast",
        } <= set(timed["ratios"])
    assert dry_run["load pattern (fast)"]["ok"]
    wide = dry_run["4 callers of beam 64 at 64 (fast)"]  # the dry run's shape of 32 callers of beam 1,024
    assert wide["ok"] and wide["requests"] == 4 and wide["requests_per_s"] > 0, wide
    assert wide["pool_tokens"] == 4 * (64 + 64 * wide["levels"]) and "graph_max_rows" in wide["execution"]
    assert {"bench_rank", "returning 200/50", "returning 400/50"} <= set(dry_run["hstu 200/50"])
