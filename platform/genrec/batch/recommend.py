"""run_batch: the recommend job (retrieve, or with `rank` recommend, for every user) on the shard pipeline."""

from __future__ import annotations

from collections.abc import Callable

from genrec.batch.pipeline import Summary, run_shards
from genrec.batch.recommend_worker import RecommendWorker
from genrec.batch.spec import BatchSpec, Execution
from genrec.errors import GenrecError, ModelDirectoryError
from genrec.model.directory import ModelDirectory, directory_family


def run_batch(spec: BatchSpec, execution: Execution = Execution()) -> Summary:
    check_generator(spec.model)
    return run_shards(spec, execution, RecommendWorker, embedding_cache(spec))


def check_generator(model: str) -> None:
    """Refuse an HSTU ranking model where a Qwen3 semantic-ID model is needed (the model is checked further as
    the engine loads it)."""
    if directory_family(model) == "hstu":
        raise ModelDirectoryError(
            model,
            "an HSTU ranking model (it ranks given candidates: jobs/batch_rank.py); batch recommendation needs a "
            "Qwen3 semantic-ID model",
        )


def embedding_cache(spec: BatchSpec) -> Callable[[], dict]:
    """The worker's further arguments, once Ray is up: with spec.cache, the EmbeddingCache actor's client."""
    directory = ModelDirectory(spec.model)

    def cache() -> dict:
        return {"cache": _connect_cache(spec, directory)} if spec.cache else {}

    return cache


def _connect_cache(spec: BatchSpec, directory: ModelDirectory):
    from genrec.cache.actor import EmbeddingCache  # after ensure_ray: it imports Ray

    return EmbeddingCache.connect(spec.cache.with_dim(_user_dim(directory)))


def _user_dim(directory: ModelDirectory) -> int:
    from safetensors import safe_open

    if not directory.soft_token_path.exists():
        raise GenrecError(f"{directory.path}: the model has no soft-token projector to take user embeddings")
    with safe_open(str(directory.soft_token_path), "pt") as tensors:
        return tensors.get_slice("weight").get_shape()[1]
