"""Batch jobs on Ray Data: `run(spec)` runs any of them (the scripts in `jobs/` derive their flags from the specs)."""

from genrec.batch.connect import ensure_ray
from genrec.batch.pipeline import Summary, run
from genrec.batch.spec import Execution, FunnelSpec, RankingExecution, RankSpec, RecommendSpec
from genrec.batch.user_embeddings import load_user_embeddings
from genrec.cache.config import CacheConfig

__all__ = [
    "CacheConfig",
    "Execution",
    "FunnelSpec",
    "RankSpec",
    "RankingExecution",
    "RecommendSpec",
    "Summary",
    "ensure_ray",
    "load_user_embeddings",
    "run",
]
