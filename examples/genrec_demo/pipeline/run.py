"""`python -m genrec_demo` (`make demo`): the whole platform on one machine, on MovieLens-100k, with a trained model.

1. MovieLens from the recbole wheel -> SVD factors -> semantic IDs -> a trained model directory (reused while
   its recipe matches; `--retrain` trains it again) -> recommend's ranking chosen on the validation items; beside
   it, in a second process, an HSTU ranker trained on the same training items (genrec_demo.ranker), reused the
   same way (genrec_demo.pipeline.prepare).
2. A local Ray. jobs/load_user_embeddings.py loads every user's vector into the EmbeddingCache actor.
3. The Serve app of deployments/funnel-local.yaml (the Qwen3 retriever and the HSTU ranker), pointed at both
   models and the cache; a few real HTTP requests (retrieve, score, recommend, and the two-stage recommend with
   the user's history) shown as movie titles.
4. jobs/batch_recommend.py --ranker: for every user, recommend (retrieve, then the label), then the HSTU
   ranker's order, to Parquet.
5. From that output: Recall@10 / NDCG@10 on each user's held-out last item of the beam order (retrieve), the
   label rerank (recommend) and the ranker's order over the same top-50, against most-popular; a recall@K plot.
   Serve and Ray are stopped on the way out, Ctrl-C included.

Outputs (git-ignored: MovieLens may not be redistributed, nor anything derived from it): the models in
`model_dir` and `ranker_dir` (default out/demo-model and out/demo-ranker, where deployments/funnel-local.yaml
looks), the rest under `out` (out/demo).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from genrec.cache.config import CacheConfig
from genrec_demo.config import DemoConfig
from genrec_demo.evaluate import measure, rankings_from_rows
from genrec_demo.model_dir import read_titles
from genrec_demo.pipeline.catalog_change import show_catalog_change
from genrec_demo.pipeline.client import Funnel, Latencies, show_filters, show_user, user_body
from genrec_demo.pipeline.cluster import app_config, local_ray, port_or_free, start_serve_app
from genrec_demo.pipeline.inputs import Prompts, write_inputs
from genrec_demo.pipeline.jobs import REPO_ROOT, JobResult, run_job
from genrec_demo.pipeline.prepare import BEAM, Prepared, prepare_models
from genrec_demo.plot import plot_recall
from genrec_demo.ranker.config import RankerConfig
from genrec_demo.summary import key_values, quality_table

SERVE_CONFIG = REPO_ROOT / "deployments" / "funnel-local.yaml"
RANK_TASK = "watch"  # the ranker's task that orders the funnel: P(the user watches the item next)
CACHE_NAME = "demo-users"
BATCH_SIZE = 64  # users per engine call and per output file of the batch job
SHOW_USERS = 2  # users whose HTTP answers are shown


def run_demo(
    out: Path = Path("out/demo"),
    model_dir: Path = Path("out/demo-model"),
    cfg: DemoConfig = DemoConfig(),
    retrain: bool = False,
    ranker_dir: Path = Path("out/demo-ranker"),
    ranker_cfg: RankerConfig | None = None,
    serve_config: Path = SERVE_CONFIG,
    port: int | None = None,
    beam: int = BEAM,
    progress: bool = True,
    say=print,
) -> dict:
    started = time.perf_counter()
    out, model_dir, ranker_dir = out.resolve(), model_dir.resolve(), ranker_dir.resolve()
    ranker_cfg = ranker_cfg or RankerConfig(seed=cfg.seed)
    prepared = prepare_models(model_dir, ranker_dir, cfg, ranker_cfg, retrain, say, progress, beam)
    data = prepared.data
    chosen = port is not None  # --port: refused if taken; the config's moves to a free one
    port = port if chosen else app_config(serve_config)["http_options"].get("port", 8000)
    models = Models(model_dir, ranker_dir, ranker_cfg.window)
    run = run_platform(out, models, prepared, cfg, serve_config, port_or_free(port, chosen), beam, say)
    evaluation = measure(rankings_from_rows(pq.read_table(run.recommendations), data, beam), data, beam)
    table = evaluation.table(10)
    title = f"MovieLens-100k, {len(data.user_ids)} users, held-out last item, seed {cfg.seed}"
    plot = plot_recall(evaluation, out / "recall_at_k.png", title)
    report = {
        "seed": cfg.seed,
        "users": len(data.user_ids),
        "model_reused": prepared.reused,
        "training": prepared.recipe["training"],
        "ranking": prepared.recipe["ranking"],
        "ranker": {"reused": prepared.ranker_reused, "training": prepared.ranker["training"], "task": RANK_TASK},
        "quality@10": table,
        "funnel vs beam order": evaluation.paired("ranker", "retrieve"),
        "recall@10 / popularity": {m: _ratio(table, m) for m in table if m != "popularity"},
        "latency": run.latencies.summary(),
        "filtered": run.filtered,
        "catalog_change": run.catalog_change,
        "embeddings_loaded": run.loaded.summary,
        "batch": run.batch.summary | {"seconds": run.batch.seconds},
        "outputs": {
            "model": str(model_dir),
            "ranker": str(ranker_dir),
            "recommendations": str(run.recommendations),
            "recall@K plot": str(plot),
            "metrics": str(out / "metrics.json"),
        },
        "wall_s": round(time.perf_counter() - started, 1),
    }
    (out / "metrics.json").write_text(json.dumps(report, indent=2))
    say(_summary(report))
    return report


@dataclass
class Models:
    retriever: Path
    ranker: Path
    window: int  # the ranker's history: each request's last events


@dataclass
class PlatformRun:
    loaded: JobResult
    batch: JobResult
    latencies: Latencies
    recommendations: Path
    catalog_change: dict
    filtered: dict


def run_platform(out, models: Models, prepared: Prepared, cfg, serve_config: Path, port: int, beam: int, say):
    """Steps 2-4 on a local Ray that is gone when this returns (or raises, Ctrl-C included)."""
    data = prepared.data
    prompts = Prompts.of(models.retriever, data, cfg.history)
    inputs = write_inputs(out, data, prompts, prepared.factors.users, models.window)
    titles = read_titles(models.retriever)
    cache = CacheConfig(name=CACHE_NAME, store="sqlite", store_path=str(out / "embeddings.sqlite"))
    batch_out = out / "batch"
    Path(cache.store_path).unlink(missing_ok=True)  # ours, from an earlier run: start clean
    shutil.rmtree(batch_out, ignore_errors=True)
    latencies = Latencies()
    say("starting a local Ray ...")
    with local_ray(num_cpus=max(4, os.cpu_count() or 1)) as address:
        load_flags = ["--embeddings", str(inputs.embeddings), *_cache_flags(cache)]
        loaded = run_job("load_user_embeddings.py", load_flags, address, say)
        say(f"starting the Serve app of {_shown(serve_config)} on port {port} ...")
        app = start_serve_app(serve_config, _app_args(serve_config, models, cache, cfg), port)
        ranking = {k: prepared.recipe["ranking"][k] for k in ("rank_by", "score_weight")}
        for u in range(min(SHOW_USERS, len(data.user_ids))):
            show_user(app.url, data, prompts, titles, u, latencies, say, ranking, Funnel(models.window, RANK_TASK))
        first = user_body(data, prompts, 0)
        say(f"\nuser {data.user_ids[0]} again, with filters (inside the beam search, not after it):")
        filtered = show_filters(app.url, first, titles, latencies, say)
        vectors = dict(zip(data.item_ids, prepared.factors.items.tolist(), strict=True))
        change = show_catalog_change(app, models.retriever, vectors, first, titles, out, latencies, say)
        say("")
        batch_flags = _batch_flags(models, inputs.users, batch_out, beam, cache, ranking)
        batch = run_job("batch_recommend.py", batch_flags, address, say)
    say("Serve and Ray are stopped")
    return PlatformRun(loaded, batch, latencies, batch_out / "recommendations", change, filtered)


def _app_args(serve_config: Path, models: Models, cache: CacheConfig, cfg: DemoConfig) -> dict:
    """The config's args pointed at the demo's models and cache (each section's other settings kept)."""
    args = app_config(serve_config).get("args", {})
    return {
        "retriever": {**args.get("retriever", {}), "model_dir": str(models.retriever)},
        "ranker": {**(args.get("ranker") or {}), "model_dir": str(models.ranker)},
        "ingress": {**args.get("ingress", {}), "cache": {**cache.model_dump(), "dim": cfg.rank}},
    }


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def _cache_flags(cache: CacheConfig) -> list[str]:
    return ["--cache", cache.name, "--cache-store", cache.store, "--cache-store-path", cache.store_path]


def _batch_flags(models: Models, users: Path, out: Path, beam: int, cache: CacheConfig, ranking: dict):
    return [
        *("--model", str(models.retriever), "--users", str(users), "--out", str(out)),
        *("--beam-width", str(beam), "--num-results", str(beam), "--score"),
        *("--order-by", ranking["rank_by"], "--score-weight", str(ranking["score_weight"])),
        *("--ranker", str(models.ranker), "--rank-task", RANK_TASK),
        *("--batch-size", str(BATCH_SIZE), "--threads", "1", "--no-progress"),
        *_cache_flags(cache),
    ]


def _ratio(table: dict, method: str) -> float | None:
    base = table["popularity"]["recall@10"]
    return round(table[method]["recall@10"] / base, 3) if base else None


def _summary(report: dict) -> str:
    training, ranking, batch, ranker = report["training"], report["ranking"], report["batch"], report["ranker"]
    return "\n\n".join(
        [
            f"quality on {report['users']} users (each one's held-out last movie, unseen items only):",
            quality_table(report["quality@10"]),
            key_values(
                "the funnel (ranker) against the beam order (retrieve), user by user", report["funnel vs beam order"]
            ),
            key_values(
                "model",
                {
                    "training": f"seed {training['seed']}, {training['steps']} steps, {training['epochs']} epochs, "
                    f"{training['cpu_s']} CPU-s" + (" (reused)" if report["model_reused"] else ""),
                    "recommend's ranking": f"beam log-prob + {ranking['score_weight']} x label log-prob, the "
                    f"weight chosen on the validation items (Recall@10 by weight: {ranking['validation recall@10']})",
                    "ranker": f"HSTU, seed {ranker['training']['seed']}, {ranker['training']['steps']} steps, "
                    f"{ranker['training']['cpu_s']} CPU-s"
                    + (" (reused)" if ranker["reused"] else "")
                    + f"; orders the top-50 by P({ranker['task']})",
                },
            ),
            key_values(
                "latency (HTTP, through the ingress and the cache)",
                report["latency"] | {"batch job": f"{batch.get('users_per_s', float('nan'))} users/s"},
            ),
            key_values("outputs", report["outputs"]),
            f"demo wall time: {report['wall_s']:.0f} s",
        ]
    )
