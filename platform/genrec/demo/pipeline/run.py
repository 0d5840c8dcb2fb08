"""`genrec demo`: MovieLens-100k -> a trained model directory (reused when its recipe matches) -> evaluation.

Outputs (git-ignored: MovieLens may not be redistributed, nor anything derived from it):
    model_dir (default out/demo-model, where deployments/local.yaml looks): the trained model directory
    out (default out/demo): recall_at_k.png (recall@K, model against most-popular), metrics.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from genrec.demo.build import build_model
from genrec.demo.config import DemoConfig
from genrec.demo.data import MovieLens, load_movielens
from genrec.demo.evaluate import evaluate
from genrec.demo.factors import svd_factors
from genrec.demo.model_dir import RECIPE, read_recipe
from genrec.demo.plot import plot_recall
from genrec.demo.summary import key_values, quality_table
from genrec.engine import Engine
from genrec.model.directory import GENREC_SUBDIR


def ensure_model(model_dir: Path, data: MovieLens, factors, cfg: DemoConfig, retrain: bool, say, progress=True):
    """Reuse the model in `model_dir` if it was trained with this recipe (and not `retrain`); else train it."""
    recipe = read_recipe(model_dir)
    if recipe is not None and recipe["config"] == cfg.to_dict() and not retrain:
        say(f"reusing the trained model in {model_dir} (--retrain to train it again)")
        return recipe, True
    why = "--retrain" if recipe is not None and recipe["config"] == cfg.to_dict() else "no model with this recipe yet"
    say(f"training the demo model ({why}): {cfg.budget_cpu_s:.0f} CPU-seconds, seed {cfg.seed}")
    (model_dir / GENREC_SUBDIR / RECIPE).unlink(missing_ok=True)  # an interrupted run must not look complete
    build_model(data, factors, model_dir, cfg, progress)
    return read_recipe(model_dir), False


def run_demo(
    out: Path = Path("out/demo"),
    model_dir: Path = Path("out/demo-model"),
    cfg: DemoConfig = DemoConfig(),
    retrain: bool = False,
    beam: int = 50,
    progress: bool = True,
    say=print,
) -> dict:
    started = time.perf_counter()
    data = load_movielens()
    if cfg.users is not None:
        data = data.head(cfg.users)
    factors = svd_factors(data, cfg.rank)
    recipe, reused = ensure_model(model_dir, data, factors, cfg, retrain, say, progress)
    engine = Engine.from_pretrained(model_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: comparable CPU time on a shared machine
    try:
        evaluation = evaluate(engine, data, factors.users, cfg.history, beam, progress)
    finally:
        torch.set_num_threads(threads)
    table = evaluation.table(10)
    plot = plot_recall(
        evaluation, out / "recall_at_k.png", f"MovieLens-100k, {len(data.user_ids)} users, seed {cfg.seed}"
    )
    report = {
        "seed": cfg.seed,
        "users": len(data.user_ids),
        "model_dir": str(model_dir),
        "model_reused": reused,
        "training": recipe["training"],
        "quality@10": table,
        "recall@10 / popularity": {
            m: round(table[m]["recall@10"] / max(table["popularity"]["recall@10"], 1e-12), 3)
            for m in ("retrieve", "recommend")
        },
        "plot": str(plot),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(report, indent=2))
    say(quality_table(table))
    say(key_values("outputs", {"model": model_dir, "recall@K plot": plot, "metrics": out / "metrics.json"}))
    return report
