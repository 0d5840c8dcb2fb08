"""Batch recommendation and ranking on Ray Data (the jobs in `jobs/` are thin wrappers around these functions)."""

from genrec.batch.connect import ensure_ray
from genrec.batch.funnel import run_funnel
from genrec.batch.funnel_spec import FunnelSpec, RankingExecution
from genrec.batch.pipeline import Summary
from genrec.batch.rank import run_rank
from genrec.batch.recommend import run_batch
from genrec.batch.spec import BatchSpec, Execution, RankSpec
from genrec.batch.user_embeddings import load_user_embeddings
from genrec.cache.config import CacheConfig

__all__ = [
    "BatchSpec",
    "CacheConfig",
    "Execution",
    "FunnelSpec",
    "RankingExecution",
    "RankSpec",
    "Summary",
    "ensure_ray",
    "load_user_embeddings",
    "run_batch",
    "run_funnel",
    "run_rank",
]
