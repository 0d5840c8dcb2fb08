"""The embedding cache: in-process table, backing stores, and (in `genrec.cache.actor`) the Ray actor."""

from genrec.cache.parquet import load_parquet
from genrec.cache.stores import RedisStore, SQLiteStore
from genrec.cache.table import EmbeddingTable

__all__ = ["EmbeddingTable", "RedisStore", "SQLiteStore", "load_parquet"]
