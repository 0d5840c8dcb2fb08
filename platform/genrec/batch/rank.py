"""run_rank: the rank job (each user's given candidates ranked by an HSTU model) on the shard pipeline."""

from __future__ import annotations

from genrec.batch.pipeline import Summary, run_shards
from genrec.batch.rank_worker import RankWorker
from genrec.batch.spec import Execution, RankSpec
from genrec.errors import GenrecError, ModelDirectoryError
from genrec.model.directory import GENREC_SUBDIR, ModelDir
from genrec.model.hstu_config import HSTU_MODEL_TYPE, HSTUConfig


def run_rank(spec: RankSpec, execution: Execution = Execution()) -> Summary:
    config = ranking_config(spec.model)
    if spec.rank_by is not None and spec.rank_by not in config.tasks:
        raise GenrecError(f"rank_by {spec.rank_by!r} is not a task of the model (its tasks: {', '.join(config.tasks)})")
    return run_shards(spec, execution, RankWorker)


def ranking_config(model: str) -> HSTUConfig:
    """The config of an HSTU ranking model directory, checked on the driver before any work; anything else
    (a Qwen3 model, a missing catalog) is one clear error."""
    directory = ModelDir.open(model)
    if directory.family != "hstu":
        raise ModelDirectoryError(
            directory.path,
            f"not an HSTU ranking model (config.json model_type is not {HSTU_MODEL_TYPE!r}); batch ranking needs "
            "one (a Qwen3 semantic-ID model recommends: jobs/batch_recommend.py)",
        )
    if not directory.catalog_path.exists():
        raise ModelDirectoryError(directory.path, f"{GENREC_SUBDIR}/catalog.parquet is missing (the item catalog)")
    return directory.config
