"""run_rank: the rank job (each user's given candidates ranked by an HSTU model) on the shard pipeline."""

from __future__ import annotations

from pathlib import Path

from genrec.batch.pipeline import Summary, run_shards
from genrec.batch.rank_worker import RankWorker
from genrec.batch.spec import Execution, RankSpec
from genrec.errors import GenrecError, ModelDirectoryError
from genrec.model.directory import GENREC_SUBDIR, directory_family
from genrec.model.hstu_config import HSTU_MODEL_TYPE, HSTUConfig


def run_rank(spec: RankSpec, execution: Execution = Execution()) -> Summary:
    config = ranking_config(spec.model)
    if spec.rank_by is not None and spec.rank_by not in config.tasks:
        raise GenrecError(f"rank_by {spec.rank_by!r} is not a task of the model (its tasks: {', '.join(config.tasks)})")
    return run_shards(spec, execution, RankWorker)


def ranking_config(model: str) -> HSTUConfig:
    """The config of an HSTU ranking model directory, checked on the driver before any work; anything else
    (a Qwen3 model, a missing catalog) is one clear error."""
    path = Path(model)
    if not path.is_dir():
        raise ModelDirectoryError(path, "model directory does not exist")
    if directory_family(path) != "hstu":
        raise ModelDirectoryError(
            path,
            f"not an HSTU ranking model (config.json model_type is not {HSTU_MODEL_TYPE!r}); batch ranking needs "
            "one (a Qwen3 semantic-ID model recommends: jobs/batch_recommend.py)",
        )
    config = HSTUConfig.from_file(path / "config.json")
    if not (path / GENREC_SUBDIR / "catalog.parquet").exists():
        raise ModelDirectoryError(path, f"{GENREC_SUBDIR}/catalog.parquet is missing (the item catalog)")
    return config
