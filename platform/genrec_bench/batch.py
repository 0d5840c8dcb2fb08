"""`genrec bench batch`: users/s of the Ray Data batch job against a plain loop over the in-process Engine
(same model, same batch size, same torch threads per engine), and how the job scales with the actor count.

End to end includes model loading on both sides (and actor start, planning, Parquet I/O on the Ray side);
steady excludes everything up to the first finished batch / committed shard.

With a ranker (an HSTU directory), the users also get histories of its items, and the same run measures the
funnel (retrieve -> rank, two Ray Data stages) between two retrieve-only jobs of the first actor count.
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
from genrec.engine import Engine
from genrec_bench.cli import BatchOptions
from genrec_bench.common import described, machine, model_dir_for, random_prompt

GOAL = 0.85
FUNNEL_GOAL = 0.6


def run(o: BatchOptions) -> dict:
    """Loop, job, loop, job, ..., loop: each job is compared with the mean of the two loops around it, so a
    machine whose load drifts during the run weighs on both sides alike. With a ranker, then: funnel, job."""
    import ray

    from genrec.batch import ensure_ray

    actors = [int(a) for a in o.actors.split(",") if a.strip()]
    model_dir = model_dir_for(o.preset, o.model, o.levels)
    work = Path(tempfile.mkdtemp(prefix="genrec-bench-batch-"))
    started = not ray.is_initialized()
    ensure_ray(include_dashboard=False, log_to_driver=False)  # a running cluster is used as it is
    try:
        loop, prompts = _plain_loop(o, model_dir)
        loops, jobs = [loop], []
        users_path = work / "users.parquet"
        columns = {"user_id": list(range(o.users)), "prompt_token_ids": prompts}
        if o.ranker is not None:
            columns["history"] = _histories(o.ranker, o.users, o.history_len)
        pq.write_table(pa.table(columns), users_path)
        for n in actors:
            jobs.append(_ray_job(o, model_dir, users_path, work / f"out-{n}", n))
            loops.append(_plain_loop(o, model_dir)[0])
        if o.ranker is not None:
            funnel_job = _ray_job(o, model_dir, users_path, work / "funnel", actors[0], ranking=True)
            retrieve_after = _ray_job(o, model_dir, users_path, work / "after", actors[0])
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if started:
            ray.shutdown()
    for job, before, after in zip(jobs, loops, loops[1:], strict=False):
        for rate in ("users_per_s", "steady_users_per_s"):
            job[f"{rate}_over_loop"] = job[rate] / ((before[rate] + after[rate]) / 2)
    first = jobs[0]
    report = {
        "benchmark": "batch",
        **described(model_dir, o, "users", "batch_size", "prompt_len", "beam_width", "threads"),
        "plain_loops": loops,
        "ray_data": jobs,
        "ratios": {
            "ray_over_loop": first["users_per_s_over_loop"],
            "ray_over_loop_steady": first["steady_users_per_s_over_loop"],
        },
        "goal": f"ray_over_loop >= {GOAL} with {first['actors']} actor(s) of {o.threads} thread(s), as the loop",
        "scaling": [
            f"{j['actors']} actor(s) x {o.threads} thread(s): {j['steady_users_per_s_over_loop']:.2f}x the loop's "
            f"steady users/s, {j['steady_users_per_s'] / first['steady_users_per_s']:.2f}x the first job's"
            for j in jobs
        ],
        "machine": machine(),
    }
    if o.ranker is not None:
        report["funnel"] = _funnel_report(first, funnel_job, retrieve_after, o)
    return report


def _funnel_report(before: dict, funnel: dict, after: dict, o: BatchOptions) -> dict:
    """The funnel's users/s over the mean of the retrieve-only jobs run before and after it."""
    ratios = {
        f"funnel_over_retrieve{suffix}": funnel[rate] / ((before[rate] + after[rate]) / 2)
        for rate, suffix in (("users_per_s", ""), ("steady_users_per_s", "_steady"))
    }
    return {
        "ranker": str(o.ranker),
        "history_len": o.history_len,
        "rank_actors": o.rank_actors,
        "retrieve_before": before,
        "funnel": funnel,
        "retrieve_after": after,
        "ratios": ratios,
        "goal": f"funnel_over_retrieve >= {FUNNEL_GOAL}: {before['actors']} retrieve actor(s) and {o.rank_actors} "
        f"ranking actor(s) of {o.threads} thread(s) against {before['actors']} retrieve actor(s)",
    }


def _histories(ranker: Path, users: int, length: int) -> list[list[dict]]:
    """`length` events per user, of the ranker's catalog items, a minute apart, actions drawn at random."""
    from genrec.batch.spec import model_dir

    directory = model_dir(str(ranker), "hstu")
    config, items = directory.config, directory.load_catalog().item_ids
    generator = torch.Generator().manual_seed(1)
    picks = torch.randint(0, len(items), (users, length), generator=generator).tolist()
    actions = torch.randint(0, config.num_actions, (users, length), generator=generator).tolist()
    return [
        [
            {"item_id": items[i], "action": a, "timestamp": 1.7e9 + 60.0 * t}
            for t, (i, a) in enumerate(zip(p, b, strict=True))
        ]
        for p, b in zip(picks, actions, strict=True)
    ]


def _plain_loop(o: BatchOptions, model_dir) -> tuple[dict, list]:
    """The loop, with `o.threads` torch threads as an actor has: (its figures, the users' prompts)."""
    before = torch.get_num_threads()
    torch.set_num_threads(o.threads)
    try:
        start = time.perf_counter()
        engine = Engine.from_pretrained(model_dir)
        load_s = time.perf_counter() - start
        generator = torch.Generator().manual_seed(0)
        prompts = [random_prompt(engine, o.prompt_len, generator) for _ in range(o.users)]
        start = time.perf_counter()
        first_batch_s = None
        for i in range(0, o.users, o.batch_size):
            chunk = prompts[i : i + o.batch_size]
            engine.retrieve([RetrieveRequest(prompt_token_ids=p, beam_width=o.beam_width) for p in chunk])
            first_batch_s = first_batch_s or time.perf_counter() - start
        compute_s = time.perf_counter() - start
    finally:
        torch.set_num_threads(before)
    report = {
        "seconds": load_s + compute_s,
        "load_s": load_s,
        "users_per_s": o.users / (load_s + compute_s),
        "steady_users_per_s": _steady(o.users, o.batch_size, compute_s, first_batch_s),
    }
    return report, prompts


def _ray_job(o: BatchOptions, model_dir, users_path, out, actors: int, ranking: bool = False) -> dict:
    """The retrieve job, or with `ranking` the funnel (o.ranker, o.rank_actors ranking actors)."""
    from genrec.batch import Execution, FunnelSpec, RankingExecution, RecommendSpec, run

    settings = dict(model=str(model_dir), users=str(users_path), out=str(out), beam_width=o.beam_width)
    execution = Execution(actors=actors, threads=o.threads, progress=False)
    if not ranking:
        summary = run(RecommendSpec(**settings, batch_size=o.batch_size), execution)
    else:
        spec = FunnelSpec(**settings, batch_size=o.batch_size, ranker=str(o.ranker))
        summary = run(spec, execution, RankingExecution(rank_actors=o.rank_actors))
    return {
        "actors": actors,
        "seconds": summary.seconds,
        "first_shard_s": summary.first_shard_s,
        "users_per_s": summary.users_per_s,
        "steady_users_per_s": _steady(summary.processed, o.batch_size, summary.seconds, summary.first_shard_s),
        "summary": summary.line(),
    }


def _steady(users, batch_size, seconds, first_s) -> float:
    """Users/s after the first batch (or shard) finished: the rate startup costs do not weigh on."""
    rest = users - min(batch_size, users)
    return rest / (seconds - first_s) if rest and seconds > first_s else users / seconds
