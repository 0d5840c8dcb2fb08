"""Batch recommendation on Ray Data (the jobs in `jobs/` are thin wrappers around these functions)."""

from genrec.batch.connect import ensure_ray
from genrec.batch.pipeline import Summary, run_batch
from genrec.batch.spec import BatchSpec, Execution
from genrec.batch.user_embeddings import load_user_embeddings
from genrec.cache.config import CacheConfig

__all__ = ["BatchSpec", "CacheConfig", "Execution", "Summary", "ensure_ray", "load_user_embeddings", "run_batch"]
