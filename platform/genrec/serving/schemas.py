"""HTTP bodies: the genrec.api requests plus an optional `user_id` whose embedding the ingress looks up."""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import BaseModel, Field, StrictInt

from genrec.api import RecommendRequest, RetrieveRequest, ScoreRequest, Text

# The cache keys integers as int64 (its two lowest values are reserved) and strings by their UTF-8 bytes.
UserId = Annotated[
    Annotated[Text, Field(min_length=1, max_length=256)] | Annotated[StrictInt, Field(ge=-(2**63) + 2, lt=2**63)],
    Field(description="looked up in the embedding cache"),
]


class _ByUser(BaseModel):
    api_model: ClassVar[type[BaseModel]]
    user_id: UserId | None = Field(
        None, description="fills user_embedding from the embedding cache (an inline user_embedding wins)"
    )

    def to_request(self, user_embedding: list[float] | None):
        """The engine's request: the same fields without user_id, with the resolved embedding."""
        fields = self.model_dump(exclude={"user_id"})
        if user_embedding is not None:
            fields["user_embedding"] = user_embedding
        return self.api_model.model_validate(fields)


class RetrieveBody(RetrieveRequest, _ByUser):
    api_model: ClassVar[type[BaseModel]] = RetrieveRequest


class ScoreBody(ScoreRequest, _ByUser):
    api_model: ClassVar[type[BaseModel]] = ScoreRequest


class RecommendBody(RecommendRequest, _ByUser):
    api_model: ClassVar[type[BaseModel]] = RecommendRequest


class ModelInfo(BaseModel):
    version: str = Field(description="content hash of the model directory")
    model_dir: str
    device: str
    catalog_items: int
    levels: int
    max_beam_width: int
    max_candidates: int
    max_prompt_tokens: int
    user_dim: int | None = Field(description="soft-token input size; None: the model has no projector")


class ErrorDetail(BaseModel):
    field: str | None = None
    message: str


class ErrorBody(BaseModel):
    code: str = Field(description="invalid_request | unauthorized | unknown_user | overloaded | timeout | unavailable")
    message: str
    details: list[ErrorDetail] = []
