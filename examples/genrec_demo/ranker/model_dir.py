"""The ranker's model directory: genrec's HSTU layout plus the recipe, reused while the recipe matches.

config.json, model.safetensors   HSTU.save
genrec/catalog.parquet           item_id (MovieLens item IDs) -> item_index (their row, `data.item_ids` order)
genrec/ranker.json               the recipe (RankerConfig, users) and the training figures; written last
"""

from __future__ import annotations

import json
from pathlib import Path

from genrec.model.directory import GENREC_SUBDIR
from genrec.testing.tiny import write_catalog
from genrec_demo.data import MovieLens
from genrec_demo.factors import Factors
from genrec_demo.ranker.config import RankerConfig
from genrec_demo.ranker.train import TrainedRanker, train_ranker

DEFAULT_DIR = Path("out/demo-ranker")
RECIPE = "ranker.json"


def recipe_of(cfg: RankerConfig, data: MovieLens) -> dict:
    """What a reusable directory must have been trained with."""
    return {"config": cfg.to_dict(), "users": len(data.user_ids)}


def write_ranker(out: Path, trained: TrainedRanker, data: MovieLens, cfg: RankerConfig) -> dict:
    trained.model.save(out)
    write_catalog(out / GENREC_SUBDIR / "catalog.parquet", list(data.item_ids), list(range(data.num_items)))
    recipe = recipe_of(cfg, data) | {"training": trained.stats}
    path = out / GENREC_SUBDIR / RECIPE
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(recipe, indent=2))
    partial.replace(path)  # last, and whole: its presence marks a complete directory
    return recipe


def read_ranker_recipe(ranker_dir: Path) -> dict | None:
    path = Path(ranker_dir) / GENREC_SUBDIR / RECIPE
    return json.loads(path.read_text()) if path.is_file() else None


def prepare_ranker(
    ranker_dir: Path, data: MovieLens, factors: Factors, cfg: RankerConfig = RankerConfig(), retrain=False, say=print
) -> tuple[dict, bool]:
    """(recipe, reused): the ranker in `ranker_dir` if its recipe matches (and not `retrain`), else trained
    there now on `data`'s training items (`factors`: the SVD of them, for the negatives)."""
    kept = kept_ranker(ranker_dir, data, cfg, retrain, say)
    return (kept, True) if kept is not None else (train_into(ranker_dir, data, factors, cfg), False)


def kept_ranker(ranker_dir: Path, data: MovieLens, cfg: RankerConfig, retrain: bool, say=print) -> dict | None:
    """The recipe of the ranker in `ranker_dir` when it is reused (it matches, and not `retrain`); else None, and
    `say` tells why it trains."""
    recipe = read_ranker_recipe(ranker_dir)
    same = recipe is not None and {k: recipe.get(k) for k in ("config", "users")} == recipe_of(cfg, data)
    if same and not retrain:
        say(f"reusing the trained ranker in {ranker_dir} (--retrain trains it again)")
        return recipe
    why = "--retrain" if same else "no ranker of this recipe yet"
    say(f"training the HSTU ranker ({why}): {cfg.steps} steps, seed {cfg.seed}")
    return None


def train_into(ranker_dir: Path, data: MovieLens, factors: Factors, cfg: RankerConfig) -> dict:
    """Train a ranker into `ranker_dir` (its recipe written last) and return the recipe."""
    ranker_dir = Path(ranker_dir)
    (ranker_dir / GENREC_SUBDIR / RECIPE).unlink(missing_ok=True)  # an interrupted run must not look complete
    return write_ranker(ranker_dir, train_ranker(data, factors, cfg), data, cfg)
