"""The GPU check's correctness rule (genrec_bench.gpu_check.judge), held on the CPU with the tiny model: a bf16
engine's answers pass against float32; a broken engine's, a result whose scores are shuffled, and items below the
k best (even with their exact scores) fail."""

import random
import subprocess
import sys

import pytest
import torch

from genrec.api import RetrieveRequest
from genrec.engine import Engine, SchedulerConfig
from genrec_bench.gpu_check import NOISE_FLOOR, exact_logprobs, judge, judged, kernel_kind, launch_counts
from tests.conftest import random_prompt

COLD = SchedulerConfig(prefix_cache_bytes=0)


@pytest.fixture(scope="module")
def bf16(tiny_dir):
    return Engine.from_pretrained(tiny_dir, dtype=torch.bfloat16, scheduler=COLD)


@pytest.fixture(scope="module")
def broken(tiny_dir):
    """bf16 with every attention output lost (o_proj zeroed): the model reads no context, as an attention bug would."""
    engine = Engine.from_pretrained(tiny_dir, dtype=torch.bfloat16, scheduler=COLD)
    for name, p in engine.model.named_parameters():
        if name.endswith("o_proj.weight"):
            p.zero_()
    return engine


def requests(engine, rng):
    return [
        RetrieveRequest(prompt_token_ids=random_prompt(engine, n, rng), beam_width=w)
        for n, w in ((40, 30), (9, 100), (120, 8))
    ]


def test_a_bf16_engine_passes_and_a_broken_one_fails(engine, bf16, broken, rng):
    for request in requests(engine, rng):  # `engine`: the session's float32 one, the reference
        got = judged({"bf16": bf16, "broken": broken}, engine, request)
        ok, bad = got["bf16"], got["broken"]
        assert ok["ok"] and max(ok["max_logprob_error"], ok["max_shortfall_below_kth_best"]) < ok["noise"] / 2
        assert not bad["ok"] and bad["max_logprob_error"] > 2 * bad["noise"]
        assert not got["ok"]


def test_a_result_with_its_scores_shuffled_fails(engine, bf16, rng):
    for request in requests(engine, rng):
        (result,) = bf16.retrieve([request])
        items, scores = [i.item_id for i in result.items], [i.logprob for i in result.items]
        exact = exact_logprobs(engine, request, items)
        kth_best = min(i.logprob for i in engine.retrieve([request])[0].items)
        assert judge(list(zip(items, scores, strict=True)), exact, kth_best)["ok"]
        random.Random(0).shuffle(scores)
        verdict = judge(list(zip(items, scores, strict=True)), exact, kth_best)
        assert not verdict["ok"] and verdict["max_logprob_error"] > verdict["noise"]


def test_items_below_the_k_best_fail_even_with_their_exact_scores(engine, rng):
    """Clause (2) alone: the k items after the float32 k best, each with its exact log-probability."""
    request = RetrieveRequest(prompt_token_ids=random_prompt(engine, 50, rng), beam_width=20)
    (best,) = engine.retrieve([request])
    (wider,) = engine.retrieve([request.model_copy(update={"beam_width": 60, "num_results": 60})])
    worse = [(i.item_id, i.logprob) for i in wider.items[-20:]]
    kth_best = min(i.logprob for i in best.items)
    verdict = judge(worse, exact_logprobs(engine, request, [item for item, _ in worse]), kth_best)
    assert not verdict["ok"] and verdict["max_logprob_error"] < 1e-4
    assert verdict["max_shortfall_below_kth_best"] > verdict["noise"]


def test_the_rule_states_its_noise_and_refuses_what_it_cannot_judge():
    exact = {"a": -0.5, "b": -1.0}
    assert judge([("a", -0.52), ("b", -0.98)], exact, -1.0) == {
        "ok": True,
        "noise": NOISE_FLOOR,  # |t_k| / 32 is less: the floor
        "max_logprob_error": pytest.approx(0.02),
        "max_shortfall_below_kth_best": pytest.approx(0.0),
        "missing": [],
    }
    assert judge([("a", -0.5), ("b", -1.0)], exact, -64.0)["noise"] == 2.0  # a share of the spread down to t_k
    assert not judge([("a", -0.5), ("b", -1.2)], exact, -1.0)["ok"]  # b's own score off its exact one
    assert not judge([("a", -0.5), ("z", -0.7)], exact, -1.0)["ok"]  # an item the float32 engine did not score
    assert not judge([], exact, -1.0)["ok"]


def test_the_gpu_check_imports_no_ray():
    """The GPU machine has no Ray: the check and every bench module it loads import without it."""
    code = (
        "import sys, genrec_bench.gpu_check, genrec_bench.load, genrec_bench.engine\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'pandas', 'fastapi', 'starlette'}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def test_the_gpu_check_runs_as_a_module_without_ray():
    """`python -m genrec_bench.gpu_check` as a GPU session runs it: -X importtime lists every module it loaded."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "genrec_bench.gpu_check", "--help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and "--budget-s" in done.stdout, done.stderr[-2000:]
    loaded = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert {"genrec_bench.cli", "genrec.engine", "torch"} <= loaded  # the listing is read right
    assert not {m for m in loaded if m.split(".")[0] in ("ray", "pandas", "fastapi", "starlette")}


def test_triton_kernels_are_the_compiled_pieces_whatever_they_fuse():
    for name in ("triton_poi_fused_cat_0", "triton_red_fused_gather_index_1", "triton_per_fused_copy_2"):
        assert kernel_kind(name) == "compiled"
    assert kernel_kind("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>") == "copy"
    assert kernel_kind("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>") == "selection"
    assert kernel_kind("flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>") == "attention"
    assert kernel_kind("nvjet_tst_128x64_64x8_1x2_h_bz_coopB_NNT") == "matmul"


def test_launch_counts_include_the_extended_launch_calls():
    """Triton launches with cuLaunchKernelEx; the runtime's extended form is cudaLaunchKernelExC."""

    class Event:
        def __init__(self, name, device_type=torch.autograd.DeviceType.CPU):
            self.name, self.device_type = name, device_type

    class Profile:
        def events(self):
            calls = ["cudaLaunchKernel"] * 3 + ["cuLaunchKernelEx"] * 2 + ["cudaLaunchKernelExC", "cuLaunchKernel"]
            kernels = [Event("k", torch.autograd.DeviceType.CUDA)] * 7
            return [Event(n) for n in [*calls, "cudaGraphLaunch", "aten::mm"]] + kernels

    counts = launch_counts(Profile())
    assert counts["launch_calls"] == 7 and counts["kernels"] == 7 and counts["graph_launches"] == 1
    assert counts["launch_calls_by_call"] == {
        "cudaLaunchKernel": 3,
        "cudaLaunchKernelExC": 1,
        "cuLaunchKernel": 1,
        "cuLaunchKernelEx": 2,
    }
