"""Which shared embedding cache to use: one type for the actor, the Serve app and the jobs."""

from __future__ import annotations

import urllib.parse
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from genrec.api import Int
from genrec.cache.policies import POLICIES
from genrec.errors import CacheError


class CacheConfig(BaseModel):
    """Created on first use with this configuration, found by name afterwards: `EmbeddingCache.connect`
    refuses another configuration under the same name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    dim: Int | None = Field(
        None,
        gt=0,
        description="the user vectors' width (the model's soft-token input size); jobs fill it in",
    )
    shards: Int = Field(1, ge=1)
    capacity: Int = Field(1_000_000, gt=0, description="vectors resident per shard")
    policy: str = Field("lru", description=f"eviction policy: one of {sorted(POLICIES)}")
    admit_after: Int = Field(1, ge=1, description="read-through misses of a key before it enters the table")
    store: Literal["sqlite", "redis", "none"] = "sqlite"
    store_path: str = Field("/tmp/genrec-embeddings.sqlite", min_length=1, description="sqlite: the file")
    redis_url: str = "redis://127.0.0.1:6379/0"

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"unknown eviction policy {value!r}; choose one of {sorted(POLICIES)}")
        return value

    @model_validator(mode="after")
    def _redis_url(self):
        scheme = urllib.parse.urlparse(self.redis_url).scheme
        if self.store == "redis" and scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"redis_url must be a redis://, rediss:// or unix:// URL, got {self.redis_url!r}")
        return self

    def with_dim(self, dim: int) -> CacheConfig:
        """This configuration for vectors of width `dim` (the model's or the file's); a different dim is refused."""
        if self.dim is not None and self.dim != dim:
            raise CacheError(f"cache {self.name!r}: dim is {self.dim} but the vectors here are {dim}-d")
        return CacheConfig.model_validate({**self.model_dump(), "dim": dim})
