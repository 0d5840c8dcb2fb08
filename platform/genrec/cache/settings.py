"""Which shared embedding cache to use, as jobs and the Serve app name it in their arguments."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class CacheSettings(BaseModel):
    """Created on first use with these settings, found by name afterwards (another configuration under the
    same name is refused by `EmbeddingCache.connect`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    shards: int = Field(1, ge=1)
    capacity: int = Field(1_000_000, gt=0)
    policy: str = "lru"
    store: Literal["sqlite", "redis", "none"] = "sqlite"
    store_path: str = "/tmp/genrec-embeddings.sqlite"
    redis_url: str = "redis://127.0.0.1:6379/0"

    def connect(self, dim: int):
        """The client of this cache's actors (imports Ray)."""
        from genrec.cache.actor import CacheConfig, EmbeddingCache

        settings = self.model_dump(exclude={"name", "shards", "dim"})
        return EmbeddingCache.connect(self.name, CacheConfig(dim=dim, **settings), shards=self.shards)
