"""The prefill attention kernel chosen by measurement (genrec.attention.choice), on the CPU through the same Python:
candidates that are stand-ins (the cuDNN candidate's own packing over torch's SDPA on the CPU, a wrong kernel, one
that raises), a timer that replays set times, and a cache file of this test's own."""

import functools
import json
import logging

import pytest
import torch

from genrec.api import Candidate, RetrieveRequest, ScoreRequest
from genrec.attention import AttentionKernels, varlen_reference
from genrec.attention.choice import ChoiceCache, HeadShape, checks, choose, prefill_choice
from genrec.attention.kernels import PREFILL_KERNEL_NAMES, prefill_kernels
from genrec.attention.prefill_kernels import dense_causal_varlen, sdpa_causal
from genrec.attention.static import static_reference
from genrec.attention.varlen import Spans
from genrec.engine import Engine
from genrec.engine.plan import ExecutionPlan
from genrec.engine_options import EngineOptions
from genrec.model.fused import PLAIN
from genrec.model.ops import ModelOps

SHAPE = HeadShape(heads=4, kv_heads=2, head_dim=16)
CPU = torch.device("cpu")
SMALL = ((1, 64), (2, 48))  # timed calls, small for the CPU


class Calls:
    """Counts which side of the cuDNN candidate each call took."""

    def __init__(self):
        self.dense = self.handed_on = 0

    def dense_call(self, *args):
        self.dense += 1
        return sdpa_causal(*args)

    def fallback(self, *args):
        self.handed_on += 1
        return varlen_reference(*args)


def cudnn_on_cpu(calls: Calls) -> AttentionKernels:
    """The cuDNN candidate's Python, its dense call torch's SDPA on the CPU, its other calls the reference."""
    varlen = functools.partial(dense_causal_varlen, dense=calls.dense_call, fallback=calls.fallback)
    return AttentionKernels("cudnn_attention (emulated)", varlen, static_reference, None)


def reference_named(name: str) -> AttentionKernels:
    return AttentionKernels(name, varlen_reference, static_reference, None)


def shifted(name: str, by: float) -> AttentionKernels:
    def varlen(*args, **kwargs):
        out, lse = varlen_reference(*args, **kwargs)
        return out + by, lse

    return AttentionKernels(name, varlen, static_reference, None)


def raising(name: str) -> AttentionKernels:
    def varlen(*args, **kwargs):
        raise RuntimeError("No available kernel. Aborting execution.")

    return AttentionKernels(name, varlen, static_reference, None)


class SetTimes:
    """A timer that runs each timed call and answers the time set for its kernel; records what it was asked."""

    def __init__(self, **ms):
        self.ms, self.asked = ms, []

    def __call__(self, name, fn):
        fn()
        self.asked.append(name)
        return self.ms[name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cudnn_candidate_takes_prompts_own_tokens_and_hands_every_other_call_on(dtype):
    """Every kind of call a plan makes (the chooser's own checks, and own tokens beside sequences without keys)
    equals the reference; only the plain causal calls over prompts' own tokens went to the dense kernel."""
    calls = Calls()
    kernels = cudnn_on_cpu(calls)
    q, k, v, *_ = checks(SHAPE, CPU, dtype)[0]
    beside_empty = Spans([0, 30, 50, 80], [0, 0, 400], [30, 0, 30])  # the middle chunk is another call's: zeros
    cases = [c[:4] + (c[5], c[6]) for c in checks(SHAPE, CPU, dtype)] + [(q[:80], k, v, beside_empty, True, False)]
    for q, k, v, spans, causal, need_lse in cases:
        out, lse = kernels.varlen(q, k, v, spans, SHAPE.head_dim**-0.5, causal, need_lse)
        want, want_lse = varlen_reference(q, k, v, spans, SHAPE.head_dim**-0.5, causal, need_lse)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out, want, atol=tol, rtol=tol)
        assert (lse is None) == (not need_lse)
    assert calls.dense == 3 + 2 and calls.handed_on == 3  # own tokens without lse: 3 and 2 sequences with keys


def test_the_fastest_candidate_that_agrees_with_the_reference_is_kept(tmp_path):
    calls = Calls()
    candidates = {
        "flash_attention_2": reference_named("flash_attention_2"),
        "wrong": shifted("wrong", 0.1),
        "raises": raising("raises"),
        "cudnn_attention": cudnn_on_cpu(calls),
    }
    timer = SetTimes(flash_attention_2=3.0, wrong=0.1, raises=0.1, cudnn_attention=2.0)
    choice = choose(candidates, SHAPE, CPU, torch.bfloat16, ChoiceCache(tmp_path / "c.json"), timer, SMALL)
    assert choice.kernels is candidates["cudnn_attention"] and choice.by == "measured"
    assert choice.timings_ms["flash_attention_2"] == {"1x64": 3.0, "2x48": 3.0, "total": 6.0}
    assert choice.timings_ms["cudnn_attention"] == {"1x64": 2.0, "2x48": 2.0, "total": 4.0}
    assert choice.timings_ms["wrong"].startswith("left out: differs from the reference by 0.1")
    assert choice.timings_ms["raises"] == "left out: RuntimeError: No available kernel. Aborting execution."
    assert timer.asked == ["flash_attention_2"] * len(SMALL) + ["cudnn_attention"] * len(SMALL)  # only those agreeing
    assert calls.dense > 0  # the timed calls ran the candidate itself


def test_a_tie_keeps_flashattention_2_and_so_does_no_agreeing_candidate(tmp_path, caplog):
    candidates = {"flash_attention_2": reference_named("flash_attention_2"), "other": reference_named("other")}
    tie = choose(candidates, SHAPE, CPU, torch.float32, None, SetTimes(flash_attention_2=1.0, other=1.0), SMALL)
    assert tie.kernels.name == "flash_attention_2"
    broken = {"flash_attention_2": shifted("flash_attention_2", 1.0), "other": raising("other")}
    with caplog.at_level(logging.WARNING, logger="genrec.attention.choice"):
        none = choose(broken, SHAPE, CPU, torch.float32, None, SetTimes(), SMALL)
    assert none.kernels.name == "flash_attention_2" and "no prefill attention kernel agreed" in caplog.text


def test_a_choice_is_measured_once_per_device_dtype_and_head_shape(tmp_path):
    cache = ChoiceCache(tmp_path / "choices" / "attention-choice.json")  # its folder is made when first written
    candidates = {"flash_attention_2": reference_named("flash_attention_2"), "other": reference_named("other")}
    first = SetTimes(flash_attention_2=2.0, other=1.0)
    assert choose(candidates, SHAPE, CPU, torch.bfloat16, cache, first, SMALL).kernels.name == "other"
    again = SetTimes()
    kept = choose(candidates, SHAPE, CPU, torch.bfloat16, cache, again, SMALL)
    assert (kept.kernels.name, kept.by, again.asked) == ("other", "cached", [])
    assert {name: t["total"] for name, t in kept.timings_ms.items()} == {"flash_attention_2": 4.0, "other": 2.0}
    for shape, dtype in ((HeadShape(8, 2, 16), torch.bfloat16), (SHAPE, torch.float16)):
        other = SetTimes(flash_attention_2=1.0, other=2.0)
        assert choose(candidates, shape, CPU, dtype, cache, other, SMALL).by == "measured" and other.asked
    assert len(json.loads(cache.path.read_text())) == 3
    fewer = {"flash_attention_2": candidates["flash_attention_2"]}  # another set of candidates: measured anew
    assert choose(fewer, SHAPE, CPU, torch.bfloat16, cache, SetTimes(flash_attention_2=1.0), SMALL).by == "measured"


def test_an_unreadable_or_unwritable_cache_costs_a_measurement_not_a_start(tmp_path, caplog):
    candidates = {"flash_attention_2": reference_named("flash_attention_2")}
    torn = ChoiceCache(tmp_path / "torn.json")
    torn.path.write_text('{"half a fi')
    with caplog.at_level(logging.WARNING, logger="genrec.attention.choice"):
        assert choose(candidates, SHAPE, CPU, torch.float32, torn, SetTimes(flash_attention_2=1.0), SMALL).by == (
            "measured"
        )
        assert len(json.loads(torn.path.read_text())) == 1  # written whole again
        (tmp_path / "a-file").write_text("")
        blocked = ChoiceCache(tmp_path / "a-file" / "attention-choice.json")  # its folder cannot be made
        chosen = choose(candidates, SHAPE, CPU, torch.float32, blocked, SetTimes(flash_attention_2=1.0), SMALL)
    assert chosen.kernels.name == "flash_attention_2"
    assert "ignoring the attention choices" in caplog.text and "could not keep the attention choice" in caplog.text


def test_the_option_names_a_kernel_or_is_refused_where_it_does_not_run(tmp_path):
    candidates = {"flash_attention_2": reference_named("flash_attention_2"), "cudnn_attention": cudnn_on_cpu(Calls())}
    named = prefill_choice("cudnn_attention", SHAPE, CPU, torch.bfloat16, candidates, timer=SetTimes())
    assert (named.kernels.name, named.by, named.timings_ms) == ("cudnn_attention (emulated)", "option", {})
    with pytest.raises(ValueError, match=r"attention: 'flash_attention_3' does not run on this device \(cpu\); here: "
                       r"auto, flash_attention_2, cudnn_attention"):  # fmt: skip
        prefill_choice("flash_attention_3", SHAPE, CPU, torch.bfloat16, candidates)
    cache = ChoiceCache(tmp_path / "c.json")
    auto = prefill_choice("auto", SHAPE, CPU, torch.bfloat16, candidates, cache, SetTimes(flash_attention_2=1.0,
                          cudnn_attention=0.5))  # fmt: skip
    assert auto.by == "measured" and auto.kernels is candidates["cudnn_attention"]
    assert auto.describe() == {"kernel": "cudnn_attention (emulated)", "by": "measured", "timings_ms": auto.timings_ms}


def test_the_options_names_are_the_kernels_and_the_cpu_plan_measures_nothing(tiny_dir):
    assert EngineOptions.model_fields["attention"].annotation.__args__[0].__args__ == ("auto", *PREFILL_KERNEL_NAMES)
    assert list(prefill_kernels(CPU)) == ["flash_attention_2"]  # cuDNN and FlashAttention-3: CUDA only
    assert "attention" not in EngineOptions().engine_kwargs()  # auto unless asked: the same results either way
    engine = Engine.from_pretrained(tiny_dir, attention="cudnn_attention")  # no effect on the CPU
    assert engine.describe_execution()["attention"] == "reference"
    assert engine.describe_execution()["attention_choice"] is None


def test_an_engine_prefilling_through_the_cudnn_candidate_answers_as_the_reference(tiny_dir, engine):
    """The candidate's Python in the engine's own prefill (packed prompts, a returning user's reused prefix, beams),
    its dense calls by SDPA on the CPU: every answer as the reference plan's."""
    calls = Calls()
    plan = ExecutionPlan(CPU, ModelOps(PLAIN, cudnn_on_cpu(calls)))
    candidate = Engine.from_pretrained(tiny_dir, plan=plan)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 200, (n,), generator=g).tolist() for n in (40, 97, 300)]
    requests = [RetrieveRequest(prompt_token_ids=p, beam_width=8, num_results=8) for p in prompts]
    requests.append(RetrieveRequest(prompt_token_ids=prompts[2] + [11, 12, 13], beam_width=8, num_results=8))
    for request in requests:
        got, want = candidate.retrieve([request])[0], engine.retrieve([request])[0]
        assert [i.item_id for i in got.items] == [i.item_id for i in want.items]
        torch.testing.assert_close(
            torch.tensor([i.logprob for i in got.items]), torch.tensor([i.logprob for i in want.items])
        )
    scored = [Candidate(item_id="item-000004"), Candidate(token_ids=[7, 8, 9])]  # the candidates read the context
    score = ScoreRequest(prompt_token_ids=prompts[1], candidates=scored)
    got, want = candidate.score([score])[0], engine.score([score])[0]
    torch.testing.assert_close(
        torch.tensor([c.logprob for c in got.scores]), torch.tensor([c.logprob for c in want.scores])
    )
    assert calls.dense > 0 and calls.handed_on > 0


def test_a_kernel_that_fails_at_prefill_size_or_answers_oddly_is_left_out_not_raised():
    """Found by a hostile probe: a kernel raising on a timed call (a shape the checks did not reach, memory), one
    answering in another shape or without the log-sum-exp asked for, and a time that is not a number each stopped
    the engine's start; now each is left out with its reason."""

    def short(*args, **kwargs):
        out, lse = varlen_reference(*args, **kwargs)
        return out[1:], lse

    def no_lse(*args, **kwargs):
        return varlen_reference(*args, **kwargs)[0], None

    candidates = {
        "flash_attention_2": reference_named("flash_attention_2"),
        "big": reference_named("big"),
        "short": AttentionKernels("short", short, static_reference, None),
        "no_lse": AttentionKernels("no_lse", no_lse, static_reference, None),
        "nan": reference_named("nan"),
    }

    def timer(name, fn):
        if name == "big":
            raise RuntimeError("cuDNN Frontend error: no valid execution plans built")
        return {"flash_attention_2": 2.0, "nan": float("nan")}.get(name, 0.5)

    choice = choose(candidates, SHAPE, CPU, torch.float32, None, timer, SMALL)
    assert choice.kernels.name == "flash_attention_2"
    left_out = {name: t for name, t in choice.timings_ms.items() if isinstance(t, str)}
    assert left_out == {
        "big": "left out: 1 x 64 tokens: RuntimeError: cuDNN Frontend error: no valid execution plans built",
        "short": "left out: answers in another shape (causal=True, lse=False)",
        "no_lse": "left out: AttributeError: 'NoneType' object has no attribute 'shape'",
        "nan": "left out: 1 x 64 tokens timed nan",
    }
    with pytest.raises(ValueError, match="attention: no prefill kernel to choose from"):
        choose({}, SHAPE, CPU, torch.float32, None, timer, SMALL)


def test_a_cached_choice_is_checked_again_and_odd_entries_are_measured_again(tmp_path):
    cache = ChoiceCache(tmp_path / "c.json")
    candidates = {"flash_attention_2": reference_named("flash_attention_2"), "other": reference_named("other")}
    choose(candidates, SHAPE, CPU, torch.float32, cache, SetTimes(flash_attention_2=2.0, other=1.0), SMALL)
    upgraded = candidates | {"other": shifted("other", 0.5)}  # the same name, a kernel that now disagrees
    again = choose(upgraded, SHAPE, CPU, torch.float32, cache, SetTimes(flash_attention_2=2.0), SMALL)
    assert (again.kernels.name, again.by) == ("flash_attention_2", "measured")
    (key,) = json.loads(cache.path.read_text())
    for odd in (["other"], {"name": "other"}, 3, None):
        cache.path.write_text(json.dumps({key: {"kernel": odd, "timings_ms": {}}}))
        timer = SetTimes(flash_attention_2=2.0, other=1.0)
        assert choose(candidates, SHAPE, CPU, torch.float32, cache, timer, SMALL).by == "measured" and timer.asked


def test_engines_starting_at_once_keep_every_choice_in_one_valid_file(tmp_path):
    """Threads of one process (as several engines of one replica) writing at once: each write whole, under the
    lock; no entry lost, no temporary file left."""
    from concurrent.futures import ThreadPoolExecutor

    cache = ChoiceCache(tmp_path / "c.json")
    candidates = {"flash_attention_2": reference_named("flash_attention_2")}

    def start(heads: int):
        return choose(candidates, HeadShape(heads, 1, 8), CPU, torch.float32, cache, SetTimes(flash_attention_2=1.0),
                      ((1, 8),))  # fmt: skip

    with ThreadPoolExecutor(8) as pool:
        assert all(c.by == "measured" for c in pool.map(start, range(1, 41)))
    assert len(json.loads(cache.path.read_text())) == 40
    assert sorted(p.name for p in tmp_path.iterdir()) == [".c.json.lock", "c.json"]
