"""The prepared check for a GPU session (issue 12): one command, about 10 minutes on an H200, JSON out.

    python -m genrec.bench.gpu_check --out gpu_check.json [--quick]

1. versions, and the schema of the FlashAttention-2 varlen aten op (seqused_k present?);
2. the CUDA varlen path (the engine option `cuda_fast`) against the plain-torch reference: decode-like spans (gaps
   in the pool, a sequence without keys, GQA) and causal prefill-like spans, bf16 and fp16, plus the float32
   reference on CUDA against the CPU; then a tiny engine's retrieve/score with the switch off and on;
3. launches per decode pass (torch.profiler) eager, eager with FA2 varlen, and replayed as a CUDA graph, and the
   graph's results against eager, Qwen3-1.7B dims, bf16, 4 requests x beam 30 at prompt 2000;
4. `genrec bench retrieve` (2000/30/5 and 1000/256/3) and `bench load` saturation, switch off and on.
Every part records its error instead of stopping the rest; the JSON is rewritten after each part.

Also `genrec bench suite` (`run_suite`): the benchmark runs a device is asked for, in priority order, one JSON file
each. Each run is isolated: a failure is written as its own JSON and the suite goes on, so a time-limited device
session still returns everything that finished.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from genrec.api import Candidate, RetrieveRequest, ScoreRequest
from genrec.attention import Spans, varlen_attention, varlen_reference
from genrec.bench.cli import LoadOptions, RetrieveOptions, ScoreOptions, SuiteOptions
from genrec.bench.common import decoder, model_dir_for, random_prompt
from genrec.engine import Engine
from genrec.model.tiny import ModelSpec, preset, write_model_dir


def versions() -> dict:
    op = torch.ops.aten._flash_attention_forward.default
    schema = str(op._schema)
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "schema": schema}
    info["schema_has_seqused_k"] = "seqused_k" in schema
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def _case(device, dtype, causal: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    KV, G, D, T = 8, 2, 128, 4096  # Qwen3-1.7B: 16 query heads, 8 KV heads, head_dim 128
    k = torch.randn(T, KV, D, generator=g).to(device, dtype)
    v = torch.randn(T, KV, D, generator=g).to(device, dtype)
    if causal:  # prefill chunks: queries = the last tokens of each prompt span
        cu_q, starts, lengths = [0, 300, 300 + 37, 300 + 37 + 5], [100, 1000, 3000], [300, 500, 5]
    else:  # decode rows: many rows per request, gaps between contexts, one request without context
        cu_q, starts, lengths = (
            [0, 30, 30 + 256, 30 + 256 + 3, 30 + 256 + 3 + 7],
            [0, 2100, 3500, 0],
            [2000, 1000, 1, 0],
        )
    q = torch.randn(cu_q[-1], KV * G, D, generator=g).to(device, dtype)
    return q, k, v, Spans(cu_q, starts, lengths)


def varlen_checks(device) -> dict:
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        for causal in (False, True):
            q, k, v, spans = _case(device, dtype, causal, 7)
            want, want_lse = varlen_reference(q.float().cpu(), k.float().cpu(), v.float().cpu(), spans, 0.088, causal)
            got, lse = varlen_attention(q, k, v, spans, 0.088, causal, fast=True)
            torch.cuda.synchronize()
            eager, _ = varlen_attention(q, k, v, spans, 0.088, causal)
            key = f"{str(dtype).split('.')[-1]}_{'causal' if causal else 'decode'}"
            finite = torch.isfinite(want_lse)
            out[key] = {
                "max_abs_out_vs_cpu_f32": (got.float().cpu() - want).abs().max().item(),
                "max_abs_out_eager_vs_cpu_f32": (eager.float().cpu() - want).abs().max().item(),
                "max_abs_lse_vs_cpu_f32": (lse.cpu()[finite] - want_lse[finite]).abs().max().item(),
                "no_key_rows_lse_is_-inf": bool((lse.cpu()[~finite] == float("-inf")).all()),
            }
            out[key]["ok"] = out[key]["max_abs_out_vs_cpu_f32"] < 2e-2 and out[key]["max_abs_lse_vs_cpu_f32"] < 1e-2
    q, k, v, spans = _case(device, torch.float32, False, 8)
    got, lse = varlen_reference(q, k, v, spans, 0.088)
    want, want_lse = varlen_reference(q.cpu(), k.cpu(), v.cpu(), spans, 0.088)
    out["float32_cuda_reference_vs_cpu"] = (got.cpu() - want).abs().max().item()
    return out


def agreement(a: Engine, b: Engine, retrieve: list, score: list) -> tuple[list[bool], float, float]:
    """Two engines on the same requests: per retrieve request, the same items or not; the largest difference of
    their beams' log-probabilities and of their scores."""
    (r0, s0), (r1, s1) = ((e.retrieve(retrieve), e.score(score)) for e in (a, b))
    same = [[i.item_id for i in x.items] == [i.item_id for i in y.items] for x, y in zip(r0, r1, strict=True)]
    beams = max(
        abs(i.logprob - j.logprob) for x, y in zip(r0, r1, strict=True) for i, j in zip(x.items, y.items, strict=False)
    )
    scores = max(abs(i.logprob - j.logprob) for i, j in zip(s0[0].scores, s1[0].scores, strict=True))
    return same, beams, scores


def engine_checks(device, architecture: str = "qwen3") -> dict:
    """A tiny engine of the decoder architecture, bf16: retrieve and score with the CUDA fast path off, then on."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / "tiny", preset("tiny", architecture=architecture))
        engine = Engine.from_pretrained(model_dir, device=device, dtype=torch.bfloat16)
        fast_engine = Engine.from_pretrained(model_dir, device=device, dtype=torch.bfloat16, cuda_fast=True)
        g = torch.Generator().manual_seed(3)
        retrieve = [
            RetrieveRequest(prompt_token_ids=random_prompt(engine, n, g), beam_width=w)
            for n, w in ((200, 30), (57, 256))
        ]
        cands = [Candidate(item_id=i) for i in engine.catalog.item_ids[:64]]
        score = [ScoreRequest(prompt_token_ids=random_prompt(engine, 90, g), candidates=cands)]
        same, beams, scores = agreement(engine, fast_engine, retrieve, score)
        return {"retrieve_items_equal": same, "retrieve_max_logprob_diff": beams, "score_max_logprob_diff": scores}


def pooled_cohorts(engine, prepared: list, pool):
    """One cohort per prepared beam request as the scheduler makes them: contexts and BeamKV slots in `pool`."""
    from genrec.engine.beam import slots_needed, start_cohort

    cohorts = []
    for p in prepared:
        ctx = pool.context(len(p.token_ids))
        logits = engine.runner.prefill([(p, ctx, 0, len(p.token_ids))])
        slots = pool.reserve(slots_needed(decoder(engine).trie, [p.request.beam_width]))
        cohorts.append(start_cohort(p.served.device_trie(), [p], [ctx], logits, slots=slots))
    return cohorts


def _cohorts(engine, prompt_len, beams):
    """Fresh cohorts of `beams` widths in a pool of their own."""
    g = torch.Generator().manual_seed(5)
    prepared = [
        engine.prepare(RetrieveRequest(prompt_token_ids=random_prompt(engine, prompt_len, g), beam_width=width))
        for width in beams
    ]
    return pooled_cohorts(engine, prepared, engine.runner.new_pool(len(beams) * (prompt_len + 4096)))


def launches_per_decode_pass(device, model_dir: Path, prompt_len: int, beams: list[int]) -> dict:
    """Kernels and launch calls of one decode pass (torch.profiler): eager with the switch off; eager with
    FA2 varlen; the static pass replayed as a CUDA graph. Also graph replay against eager (logprobs, items)."""
    from torch.profiler import ProfilerActivity, profile

    from genrec.engine.beam import fetch_finals

    engines = {
        fast: Engine.from_pretrained(model_dir, device=device, dtype=torch.bfloat16, cuda_fast=fast)
        for fast in (False, True)
    }
    out, finals = {}, {}
    for mode in ("eager", "varlen", "graphs"):
        engine = engines[mode != "eager"]
        cohorts, bucketed = _cohorts(engine, prompt_len, beams), mode == "graphs"
        engine.runner.decode(cohorts, bucketed)  # warm-up (and capture) on the first pass
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            engine.runner.decode(cohorts, bucketed)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        while not all(c.done for c in cohorts):
            engine.runner.decode([c for c in cohorts if not c.done], bucketed)
        finals[mode] = fetch_finals(cohorts)
        names = [e.name for e in prof.events()]
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        launch = sum(n in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC") for n in names)
        out[mode] = {
            "kernels": len(kernels),
            "launch_calls": launch,
            "graph_launches": names.count("cudaGraphLaunch"),
            "seconds": seconds,
        }
    for mode in ("varlen", "graphs"):
        same = [a[1] == b[1] for a, b in zip(finals["eager"], finals[mode], strict=True)]
        diff = max(
            max(abs(x - y) for x, y in zip(a[0], b[0], strict=True))
            for a, b in zip(finals["eager"], finals[mode], strict=True)
        )
        out[f"{mode}_items_equal_eager"], out[f"{mode}_max_score_diff"] = same, diff
    return out


def bench(args: list[str], fast: bool, timeout: int) -> dict:
    cmd = [sys.executable, "-m", "genrec.cli", "bench", *args, *(["--cuda-fast"] if fast else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        return {"error": done.stderr[-3000:], "cmd": " ".join(cmd)}
    result = json.loads(done.stdout)
    return {k: result[k] for k in ("seconds", "ratios", "saturation", "rates") if k in result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--quick", action="store_true", help="checks and launch counts only, no benches")
    parser.add_argument("--budget-s", type=float, default=540.0, help="parts that would start later are skipped")
    args = parser.parse_args()
    device = "cuda"
    report: dict = {}
    deadline = time.perf_counter() + args.budget_s

    def part(name, fn):
        start = time.perf_counter()
        if start > deadline:
            report[name] = {"skipped": "out of time (--budget-s)"}
            args.out.write_text(json.dumps(report, indent=2, default=str))
            return
        try:
            report[name] = fn()
        except Exception:  # noqa: BLE001 - a failing part is reported, the others still run
            report[name] = {"error": traceback.format_exc()[-3000:]}
        report.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 1)
        args.out.write_text(json.dumps(report, indent=2, default=str))
        print(name, json.dumps(report[name], default=str)[:2000], flush=True)

    part("versions", versions)
    part("varlen", lambda: varlen_checks(device))
    part("engine", lambda: engine_checks(device))
    part("engine qwen2", lambda: engine_checks(device, "qwen2"))

    def shape(command: str, prompt_len: int, beam: int, levels: int) -> list[str]:
        sizes = ["--prompt-len", str(prompt_len), "--beam-width", str(beam), "--levels", str(levels)]
        return [command, "--preset", "qwen3-1.7b", "--device", device, *sizes]

    no_hf = ["--no-hf-baseline", "--repeats", "5"]
    retrieve = {
        "2000/30/5": shape("retrieve", 2000, 30, 5) + no_hf,
        "1000/256/3": shape("retrieve", 1000, 256, 3) + no_hf,
    }
    if not args.quick:
        for name, cli in retrieve.items():
            for fast in (False, True):
                part(f"retrieve {name} {'fast' if fast else 'eager'}", lambda cli=cli, fast=fast: bench(cli, fast, 240))

    def launches():
        return launches_per_decode_pass(device, model_dir_for("qwen3-1.7b", None, 5), 2000, [30, 30, 30, 30])

    part("launches_per_decode_pass 4 x 2000/30", launches)
    if not args.quick:
        load = shape("load", 2000, 30, 5) + ["--rates", "60", "--duration", "5"]
        for fast in (False, True):
            part(f"load 2000/30/5 {'fast' if fast else 'eager'}", lambda fast=fast: bench(load, fast, 240))


def gpu_consistency(device: str) -> dict:
    """The same tiny model in float32 on CPU and on the device: same beams, same scores."""
    model_dir = write_model_dir(Path(tempfile.mkdtemp()) / "m", ModelSpec(items=300, levels=3, codebook=8))
    cpu = Engine.from_pretrained(model_dir, device="cpu", dtype=torch.float32)
    dev = Engine.from_pretrained(model_dir, device=device, dtype=torch.float32)
    retrieve = [RetrieveRequest(prompt_token_ids=list(range(5, 5 + n)), beam_width=w) for n, w in ((40, 300), (7, 5))]
    score = [ScoreRequest(prompt="user liked", candidates=[Candidate(item_id=i) for i in cpu.catalog.item_ids[:50]])]
    same, beams, scores = agreement(cpu, dev, retrieve, score)
    return {"same_items": all(same), "max_logprob_diff": beams, "max_score_diff": scores}


def suite_runs(device: str, preset_name: str):
    from genrec.bench import engine, load

    yield "consistency", lambda: gpu_consistency(device)
    shape = dict(preset=preset_name, device=device, prompt_len=2000, beam_width=30, levels=5)
    for running in (64, 16, 8):
        options = LoadOptions(rates="8,16,24,32", duration=6.0, candidates=100, burst=64, max_running=running, **shape)
        yield f"load-2000-30-5-running{running}", lambda o=options: load.run(o)
    yield "retrieve-2000-30-5", lambda: engine.retrieve(RetrieveOptions(**shape, repeats=5, user_embedding=True))
    wide = {**shape, "prompt_len": 1000, "beam_width": 256, "levels": 3}
    yield "retrieve-1000-256-3", lambda: engine.retrieve(RetrieveOptions(**wide, repeats=5))
    score = ScoreOptions(
        prefix_len=1000, candidates=500, preset=preset_name, device=device, repeats=5, fanout_sample=50
    )
    yield "score-1000-500", lambda: engine.score(score)
    batch8 = RetrieveOptions(**shape, batch=8, repeats=3, hf_baseline=False)
    yield "retrieve-batch8-2000-30-5", lambda: engine.retrieve(batch8)


def run_suite(o: SuiteOptions) -> dict:
    o.out.mkdir(parents=True, exist_ok=True)
    only = o.only.split(",") if o.only else None
    summary = {}
    for name, fn in suite_runs(o.device, o.preset):
        if only and name not in only:
            continue
        start = time.perf_counter()
        try:
            report = fn()
            status = "ok"
        except Exception as err:  # noqa: BLE001 - recorded, the suite goes on
            report = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            status = "error"
        report["wall_seconds"] = time.perf_counter() - start
        (o.out / f"{name}.json").write_text(json.dumps(report, indent=2))
        summary[name] = {"status": status, "ratios": report.get("ratios"), "wall_seconds": report["wall_seconds"]}
        print(json.dumps({name: summary[name]}), flush=True)
    return summary


if __name__ == "__main__":
    main()
