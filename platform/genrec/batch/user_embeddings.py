"""User embeddings for batch jobs from the shared EmbeddingCache actor: lookup by user_id, and bulk load."""

from __future__ import annotations

from types import SimpleNamespace

from genrec.cache.config import CacheConfig
from genrec.errors import GenrecError


def lookup(cache, user_ids: list) -> list[list[float] | None]:
    """Each user's embedding from the cache, None where it has none (or the user_id is null)."""
    present = [i for i, u in enumerate(user_ids) if u is not None]
    out: list[list[float] | None] = [None] * len(user_ids)
    if present:
        vectors, found = cache.get([user_ids[i] for i in present])  # a list: mixed int/str IDs are refused
        for i, vector, hit in zip(present, vectors, found, strict=True):
            if hit:
                out[i] = vector.tolist()
    return out


def load_user_embeddings(path: str, config: CacheConfig, dim: int | None = None, batch_rows: int = 65536) -> dict:
    """Bulk-load a `user_id, embedding` Parquet into the cache; width: `dim`, the config's, or the file's."""
    from genrec.batch.connect import ensure_ray
    from genrec.cache import load_parquet

    config = config.with_dim(dim or config.dim or _embedding_dim(path))
    ensure_ray()
    from genrec.cache.actor import EmbeddingCache  # after ensure_ray: it imports Ray

    cache = EmbeddingCache.connect(config)
    # Each put writes the actor's durable store, then its table: the load is durable and warms the actor in one pass.
    loaded = load_parquet(path, SimpleNamespace(dim=config.dim, put_many=cache.put), batch_rows=batch_rows)
    resident = sum(s["resident"] for s in cache.stats())
    return {"cache": config.name, "shards": config.shards, "dim": config.dim, "loaded": loaded, "resident": resident}


def _embedding_dim(path: str) -> int:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, ValueError) as err:
        raise GenrecError(f"{path}: not a readable Parquet file ({err})") from None
    if "embedding" not in parquet.schema_arrow.names:
        raise GenrecError(f"{path}: column 'embedding' is missing (have {parquet.schema_arrow.names})")
    first = parquet.read_row_group(0, columns=["embedding"]).column(0) if parquet.num_row_groups else None
    if first is None or len(first) == 0 or first[0].as_py() is None:
        raise GenrecError(f"{path}: no embeddings to take the dimension from (pass the dimension explicitly)")
    return len(first[0].as_py())
