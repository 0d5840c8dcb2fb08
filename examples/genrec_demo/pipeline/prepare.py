"""The demo's two models, trained (or reused) before the platform starts.

The retriever trains in this process and the HSTU ranker in a second one at the same time: each on one thread,
so the models are those of training them one after the other, in about the time of the longer of the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

from genrec.errors import GenrecError
from genrec.model.directory import GENREC_SUBDIR
from genrec_demo.build import build_model
from genrec_demo.calibrate import choose_ranking, is_current
from genrec_demo.catalog import complete_catalog
from genrec_demo.config import DemoConfig
from genrec_demo.data import MovieLens, load_movielens
from genrec_demo.factors import Factors, svd_factors
from genrec_demo.model_dir import RECIPE, read_recipe, write_recipe
from genrec_demo.ranker.config import RankerConfig
from genrec_demo.ranker.model_dir import kept_ranker, train_into
from genrec_demo.train import one_thread

BEAM = 50  # items retrieved, then ranked, per user


@dataclass
class Prepared:
    data: MovieLens
    factors: Factors
    recipe: dict
    reused: bool
    ranker: dict | None = None  # the ranker's recipe (prepare_models)
    ranker_reused: bool = False


def prepare_models(model_dir: Path, ranker_dir: Path, cfg: DemoConfig, ranker_cfg: RankerConfig, retrain: bool, say,
                   progress: bool = True, beam: int = BEAM) -> Prepared:  # fmt: skip
    """`prepare`, and the HSTU ranker in `ranker_dir` (reused the same way) on the same data, trained beside it."""
    inputs = demo_inputs(cfg)
    kept = kept_ranker(ranker_dir, inputs[0], ranker_cfg, retrain, say)
    if kept:
        prepared = prepare(model_dir, cfg, retrain, say, progress, beam, inputs)
        prepared.ranker, prepared.ranker_reused = kept, True
        return prepared
    # A pool, not a bare process: leaving the block (Ctrl-C, an error here) terminates the ranker's training too.
    with get_context("spawn").Pool(1) as pool:
        training = pool.apply_async(train_into, (ranker_dir, *inputs, ranker_cfg))
        prepared = prepare(model_dir, cfg, retrain, say, progress, beam, inputs)
        prepared.ranker, prepared.ranker_reused = training.get(), False
    return prepared


def prepare(model_dir: Path, cfg: DemoConfig, retrain: bool, say, progress: bool = True, beam: int = BEAM,
            inputs: tuple[MovieLens, Factors] | None = None) -> Prepared:  # fmt: skip
    """The data and a trained model: the one in `model_dir` if its recipe matches (and not `retrain`), with
    recommend's ranking for `beam` chosen on the validation items (kept in the recipe). `inputs`: `demo_inputs(cfg)`
    when already read."""
    data, factors = inputs or demo_inputs(cfg)
    recipe = read_recipe(model_dir)
    same = recipe is not None and recipe["config"] == cfg.to_dict()
    reused = same and not retrain
    if reused:
        say(f"reusing the trained model in {model_dir} (--retrain trains it again)")
    else:
        why = "--retrain" if same else "no model of this recipe yet"
        length = f"{cfg.max_steps} steps" if cfg.max_steps else f"{cfg.budget_cpu_s:.0f} CPU-seconds of one thread"
        say(f"training the demo model ({why}): {length}, seed {cfg.seed}")
        (model_dir / GENREC_SUBDIR / RECIPE).unlink(missing_ok=True)  # an interrupted run must not look complete
        with one_thread():  # build-ids' k-means too
            build_model(data, factors, model_dir, cfg, progress)
        recipe = read_recipe(model_dir)
    with one_thread():  # build-ids' k-means, as at training
        completed = complete_catalog(model_dir, data, factors, cfg.seed)
    if completed:
        say(f"added the codebooks and the movies' attributes to {model_dir}'s catalog (a model trained before them)")
    if not is_current(recipe.get("ranking"), beam):
        say(f"choosing recommend's ranking on the validation items (beam {beam}) ...")
        recipe["ranking"] = choose_ranking(model_dir, data, factors.users, cfg.history, beam)
        write_recipe(model_dir, recipe)
    return Prepared(data, factors, recipe, reused)


def demo_inputs(cfg: DemoConfig) -> tuple[MovieLens, Factors]:
    """MovieLens (its first `cfg.users` users when set) and the SVD factors of its training items."""
    data = load_movielens()
    if cfg.users is not None:
        if cfg.users > len(data.user_ids):
            raise GenrecError(f"--users {cfg.users}: MovieLens-100k has {len(data.user_ids)} users")
        data = data.head(cfg.users)
    return data, demo_factors(data, cfg.rank)


def demo_factors(data: MovieLens, rank: int) -> Factors:
    """The SVD on one thread: its last bits depend on the thread count, and through the semantic IDs so would the
    whole model; on one thread a recipe gives the same model on any machine."""
    with one_thread():
        return svd_factors(data, rank)
