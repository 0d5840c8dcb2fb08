"""Request and response models shared by the engine, Ray Serve, Ray Data jobs and the CLI."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_BEAM_WIDTH = 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptInput(_Strict):
    """A prompt given as text or as token IDs (exactly one), with an optional soft-token user vector.

    `user_embedding` replaces the embedding of every `<|user|>` placeholder in the prompt with
    `weight @ user_embedding + bias` (one vector for all placeholders of the prompt).
    """

    prompt: str | None = None
    prompt_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    user_embedding: list[float] | None = None
    request_id: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of 'prompt' (text) or 'prompt_token_ids'")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("'prompt' is empty")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("'prompt_token_ids' is empty")
        return self

    @field_validator("user_embedding")
    @classmethod
    def _finite(cls, value):
        if value is not None:
            if not value:
                raise ValueError("'user_embedding' is empty")
            if not all(math.isfinite(x) for x in value):
                raise ValueError("'user_embedding' has a non-finite value (NaN or infinity)")
        return value


class RetrieveRequest(PromptInput):
    beam_width: int = Field(30, ge=1, le=MAX_BEAM_WIDTH)
    num_results: int | None = Field(None, ge=1, description="default: beam_width")
    exclude_item_ids: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _results_within_beam(self):
        if self.num_results is None:
            self.num_results = self.beam_width
        if self.num_results > self.beam_width:
            raise ValueError(f"num_results ({self.num_results}) exceeds beam_width ({self.beam_width})")
        return self


class ScoredItem(BaseModel):
    item_id: str
    semantic_id: list[int]
    logprob: float


class RetrieveResult(BaseModel):
    request_id: str | None = None
    items: list[ScoredItem]
    prompt_tokens: int
    unknown_exclusions: int = Field(0, description="exclude_item_ids not in the catalog (ignored)")


class Candidate(_Strict):
    """One candidate to score: a catalog item (scored by its semantic-ID tokens), token IDs, or text."""

    item_id: str | None = None
    token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    text: str | None = None

    @model_validator(mode="after")
    def _one_form(self):
        given = [name for name in ("item_id", "token_ids", "text") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"a candidate needs exactly one of item_id, token_ids, text (got {given or 'none'})")
        if self.text is not None and not self.text.strip():
            raise ValueError("candidate 'text' is empty")
        if self.token_ids is not None and not self.token_ids:
            raise ValueError("candidate 'token_ids' is empty")
        if self.item_id is not None and not self.item_id:
            raise ValueError("candidate 'item_id' is empty")
        return self


class ScoreRequest(PromptInput):
    candidates: list[Candidate] = Field(min_length=1)
    labels: tuple[str, str] = Field(("yes", "no"), description="(positive, negative) label tokens")


class CandidateScore(BaseModel):
    item_id: str | None = None
    logprob: float = Field(description="full-vocabulary log-softmax of the positive label after the candidate")
    prob: float = Field(description="softmax over the two labels only: P(positive)")


class ScoreResult(BaseModel):
    request_id: str | None = None
    scores: list[CandidateScore]
    prompt_tokens: int


class RecommendRequest(RetrieveRequest):
    """Retrieve by beam search, then score the retrieved items (plus any given candidates) on the same prefill."""

    candidates: list[Candidate] = Field(default_factory=list)
    labels: tuple[str, str] = ("yes", "no")


class RecommendedItem(BaseModel):
    item_id: str | None = None
    semantic_id: list[int] | None = None
    retrieval_logprob: float | None = Field(None, description="beam-search logprob; None for given candidates")
    score_logprob: float
    prob: float
    source: str = Field(description="'retrieved' or 'given'")


class RecommendResult(BaseModel):
    request_id: str | None = None
    items: list[RecommendedItem] = Field(description="ranked by score_logprob, best first")
    prompt_tokens: int
    unknown_exclusions: int = 0
