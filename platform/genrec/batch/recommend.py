"""run_batch: the recommend job (retrieve, or with `rank` recommend, for every user) on the shard pipeline."""

from __future__ import annotations

from collections.abc import Callable

from genrec.batch.pipeline import Summary, run_shards
from genrec.batch.recommend_worker import RecommendWorker
from genrec.batch.spec import BatchSpec, Execution
from genrec.errors import GenrecError, ModelDirectoryError
from genrec.model.directory import ModelDir


def run_batch(spec: BatchSpec, execution: Execution = Execution()) -> Summary:
    check_generator(spec.model)
    return run_shards(spec, execution, RecommendWorker, embedding_cache(spec))


def check_generator(model: str) -> None:
    """Refuse an HSTU ranking model where a Qwen3 semantic-ID model is needed (the model is checked further as
    the engine loads it)."""
    if ModelDir.open(model).family == "hstu":
        raise ModelDirectoryError(
            model,
            "an HSTU ranking model (it ranks given candidates: jobs/batch_rank.py); batch recommendation needs a "
            "Qwen3 semantic-ID model",
        )


def embedding_cache(spec: BatchSpec) -> Callable[[], dict]:
    """The worker's further arguments, once Ray is up: with spec.cache, the EmbeddingCache actor's client."""
    directory = ModelDir.open(spec.model)

    def cache() -> dict:
        return {"cache": _connect_cache(spec, directory)} if spec.cache else {}

    return cache


def _connect_cache(spec: BatchSpec, directory: ModelDir):
    from genrec.cache.actor import EmbeddingCache  # after ensure_ray: it imports Ray

    if directory.user_dim is None:
        raise GenrecError(f"{directory.path}: the model has no soft-token projector to take user embeddings")
    return EmbeddingCache.connect(spec.cache.with_dim(directory.user_dim))
