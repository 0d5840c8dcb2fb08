"""`genrec bench batch`: users/s of the Ray Data batch job against a plain loop over the in-process Engine
(same model, same batch size, same torch threads per engine), and how the job scales with the actor count.

End to end includes model loading on both sides (and actor start, planning, Parquet I/O on the Ray side);
steady excludes everything up to the first finished batch / committed shard.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from genrec.api import RetrieveRequest
from genrec.bench.common import machine, model_dir_for, random_prompt
from genrec.engine import Engine

GOAL = 0.85


def run(users, batch_size, preset, model, levels, prompt_len, beam_width, actors: list[int], threads) -> dict:
    """Loop, job, loop, job, ..., loop: each job is compared with the mean of the two loops around it, so a
    machine whose load drifts during the run weighs on both sides alike."""
    import ray

    from genrec.batch import ensure_ray

    model_dir = model_dir_for(preset, model, levels)
    work = Path(tempfile.mkdtemp(prefix="genrec-bench-batch-"))
    started = not ray.is_initialized()
    ensure_ray(include_dashboard=False, log_to_driver=False)  # a running cluster is used as it is
    try:
        loop, prompts = _plain_loop(model_dir, users, batch_size, prompt_len, beam_width, threads)
        loops, jobs = [loop], []
        users_path = work / "users.parquet"
        pq.write_table(pa.table({"user_id": list(range(users)), "prompt_token_ids": prompts}), users_path)
        for n in actors:
            jobs.append(_ray_job(model_dir, users_path, work / f"out-{n}", batch_size, beam_width, n, threads))
            loops.append(_plain_loop(model_dir, users, batch_size, prompt_len, beam_width, threads)[0])
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if started:
            ray.shutdown()
    for job, before, after in zip(jobs, loops, loops[1:], strict=False):
        for rate in ("users_per_s", "steady_users_per_s"):
            job[f"{rate}_over_loop"] = job[rate] / ((before[rate] + after[rate]) / 2)
    first = jobs[0]
    return {
        "benchmark": "batch",
        "model": str(model_dir),
        "preset": None if model else preset,
        "users": users,
        "batch_size": batch_size,
        "prompt_len": prompt_len,
        "beam_width": beam_width,
        "threads": threads,
        "plain_loops": loops,
        "ray_data": jobs,
        "ratios": {
            "ray_over_loop": first["users_per_s_over_loop"],
            "ray_over_loop_steady": first["steady_users_per_s_over_loop"],
        },
        "goal": f"ray_over_loop >= {GOAL} with {first['actors']} actor(s) of {threads} thread(s), as the loop",
        "scaling": [
            f"{j['actors']} actor(s) x {threads} thread(s): {j['steady_users_per_s_over_loop']:.2f}x the loop's "
            f"steady users/s, {j['steady_users_per_s'] / first['steady_users_per_s']:.2f}x the first job's"
            for j in jobs
        ],
        "machine": machine(),
    }


def _plain_loop(model_dir, users, batch_size, prompt_len, beam_width, threads) -> tuple[dict, list]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _timed_loop(model_dir, users, batch_size, prompt_len, beam_width)
    finally:
        torch.set_num_threads(before)


def _timed_loop(model_dir, users, batch_size, prompt_len, beam_width) -> tuple[dict, list]:
    start = time.perf_counter()
    engine = Engine.from_pretrained(model_dir)
    load_s = time.perf_counter() - start
    generator = torch.Generator().manual_seed(0)
    prompts = [random_prompt(engine, prompt_len, generator) for _ in range(users)]
    start = time.perf_counter()
    first_batch_s = None
    for i in range(0, users, batch_size):
        engine.retrieve(
            [RetrieveRequest(prompt_token_ids=p, beam_width=beam_width) for p in prompts[i : i + batch_size]]
        )
        first_batch_s = first_batch_s or time.perf_counter() - start
    compute_s = time.perf_counter() - start
    report = {
        "seconds": load_s + compute_s,
        "load_s": load_s,
        "users_per_s": users / (load_s + compute_s),
        "steady_users_per_s": _steady(users, batch_size, compute_s, first_batch_s),
    }
    return report, prompts


def _ray_job(model_dir, users_path, out, batch_size, beam_width, actors, threads) -> dict:
    from genrec.batch import BatchSpec, Execution, run_batch

    spec = BatchSpec(
        model=str(model_dir), users=str(users_path), out=str(out), beam_width=beam_width, batch_size=batch_size
    )
    summary = run_batch(spec, Execution(actors=actors, threads=threads, progress=False))
    return {
        "actors": actors,
        "seconds": summary.seconds,
        "first_shard_s": summary.first_shard_s,
        "users_per_s": summary.users_per_s,
        "steady_users_per_s": _steady(summary.processed, batch_size, summary.seconds, summary.first_shard_s),
        "summary": summary.line(),
    }


def _steady(users, batch_size, seconds, first_s) -> float:
    """Users/s after the first batch (or shard) finished: the rate startup costs do not weigh on."""
    rest = users - min(batch_size, users)
    return rest / (seconds - first_s) if rest and seconds > first_s else users / seconds
