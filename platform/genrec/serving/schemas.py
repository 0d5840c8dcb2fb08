"""HTTP bodies: the genrec.api requests plus an optional `user_id` (and, for a two-stage /v1/recommend, the
ranker's `history`), what /v1/model describes, and the error body."""

from __future__ import annotations

import hashlib
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, Discriminator, Field, StrictInt, StrictStr, Tag, model_validator

from genrec.api import Event, RankRequest, RecommendRequest, RetrieveRequest, ScoreRequest, Text, field_error


def _user_id_kind(value) -> str | None:
    if isinstance(value, str):
        return "string"
    return "integer" if isinstance(value, int) and not isinstance(value, bool) else None


# The cache keys integers as int64 (its two lowest values reserved). A tagged union checks a value as the one kind
# it is, so a 422 says what is wrong (a plain union reports both members' errors, under their validators' names).
# The length is checked before Text's own checks (valid Unicode), so its message speaks of characters.
UserId = Annotated[
    Annotated[StrictStr, Field(min_length=1, max_length=256), *Text.__metadata__, Tag("string")]
    | Annotated[Annotated[StrictInt, Field(ge=-(2**63) + 2, lt=2**63)], Tag("integer")],
    Discriminator(
        _user_id_kind,
        custom_error_type="user_id_type",
        custom_error_message="must be a string (1 to 256 characters) or an integer",
    ),
    Field(description="the user: requests of one user go to the engine replica that holds their K/V"),
]


def cache_scope(body) -> str | None:
    """The prefix-cache scope of a body's engine requests (docs/serving.md, "The prefix cache's scope"): its
    `cache_scope`, else a digest of repr(user_id) (so any user_id fits the field's length), else None (private)."""
    if body.cache_scope is not None:
        return body.cache_scope
    if body.user_id is None:
        return None
    return "user:" + hashlib.blake2b(repr(body.user_id).encode(), digest_size=16).hexdigest()


def refuse_repeated_items(body: BaseModel, item_ids: list[str | None]) -> None:
    """Score and rank answer one row per candidate, in order: an item given twice is refused, at its second place
    and naming its first (recommend, one row per item, merges them instead: docs/serving.md, "Routes"). None: a
    candidate without an item ID (text, token IDs), never a repeat."""
    first: dict[str, int] = {}
    for i, item in enumerate(item_ids):
        if item is None:
            continue
        if item in first:
            problem = f"repeats candidates[{first[item]}] (item {item!r}): give each item once"
            raise field_error(body, ("candidates", i), problem)
        first[item] = i


class _ByUser(BaseModel):
    api_model: ClassVar[type[BaseModel]]
    ingress_fields: ClassVar[set[str]] = {"user_id"}  # what the ingress reads and the engine's request lacks
    user_id: UserId | None = Field(
        None,
        description="fills user_embedding from the embedding cache (an inline user_embedding wins), routes the "
        "request to the engine replica that holds this user's prompts, and scopes the prefix cache: what this "
        "request leaves there is reused by this user's requests only (unless cache_scope names another scope)",
    )

    def to_request(self, user_embedding: list[float] | None):
        """The engine's request: the same fields without user_id, with the resolved embedding and the cache scope."""
        fields = self.model_dump(exclude=self.ingress_fields) | {"cache_scope": cache_scope(self)}
        if user_embedding is not None:
            fields["user_embedding"] = user_embedding
        return self.api_model.model_validate(fields)


class RetrieveBody(RetrieveRequest, _ByUser):
    api_model: ClassVar[type[BaseModel]] = RetrieveRequest


class ScoreBody(ScoreRequest, _ByUser):
    api_model: ClassVar[type[BaseModel]] = ScoreRequest

    @model_validator(mode="after")
    def _items_once(self):
        refuse_repeated_items(self, [candidate.item_id for candidate in self.candidates])
        return self


class RecommendBody(RecommendRequest, _ByUser):
    """Without `history`: the retrieval model's recommend, as ever. With it (an app with a ranker): two stages,
    the retrieved items then ranked by the ranker after the history (funnel.py)."""

    api_model: ClassVar[type[BaseModel]] = RecommendRequest
    ingress_fields: ClassVar[set[str]] = {"user_id", "history", "rank_task"}
    history: list[Event] | None = Field(
        None,
        min_length=1,
        description="the user's events, oldest first, in the ranker's form (the prompt stays the retriever's): "
        "ranks every retrieved item by the app's ranker; refused (422) by an app without one",
    )
    rank_task: Text | None = Field(
        None, description="with history: the ranker's task whose probability orders the items (default: its first)"
    )

    @model_validator(mode="after")
    def _task_with_history(self):
        if self.rank_task is not None and self.history is None:
            raise field_error(self, "rank_task", "applies to a two-stage recommend only: send 'history' with it")
        return self


class RankBody(RankRequest):
    user_id: UserId | None = Field(
        None,
        description="routes the request to the engine replica that holds this user's history (no lookup), and "
        "scopes the prefix cache by the user (unless cache_scope names another scope)",
    )

    @model_validator(mode="after")
    def _items_once(self):
        refuse_repeated_items(self, self.candidates)
        return self

    def to_request(self, user_embedding: None = None) -> RankRequest:
        """The engine's request: without user_id (a ranker has no soft token), with the cache scope."""
        return RankRequest.model_validate(self.model_dump(exclude={"user_id"}) | {"cache_scope": cache_scope(self)})


class RankerFacts(BaseModel):
    """What the ingress checks a two-stage recommend against before stage 1 runs (the first task is the default)."""

    tasks: list[str]
    max_history_events: int
    max_candidates: int

    @classmethod
    def of(cls, config, max_candidates: int) -> RankerFacts:
        """From the ranker's HSTU config (genrec.model.config.HSTUConfig) and its engine's limit."""
        events = config.max_history_events
        return cls(tasks=list(config.tasks), max_history_events=events, max_candidates=max_candidates)


# `declared`: serves its declared catalog; `kept_running`: refused a live change, serves the one before;
# `refusing`: no declared catalog since its start, answers 503 catalog_not_served (docs/serving.md, "Live changes").
CatalogStatus = Literal["declared", "kept_running", "refusing"]
CATALOG_DECLARED = "the catalog file the replica's user_config declares (the model directory's when it names none)"
NOT_DECLARED_SINCE = (
    "qwen3: since when (Unix seconds) the replica has not served its declared catalog (None: it serves it); it "
    "checks the file every few seconds and loads it once it is readable and valid"
)


class ReplicaState(BaseModel):
    replica: str
    catalog_version: str | None = None
    previous_catalog_version: str | None = None
    catalog_items: int | None = None
    catalog_refused: str | None = None
    catalog_declared: str | None = Field(None, description=CATALOG_DECLARED)
    catalog_status: CatalogStatus | None = None
    catalog_not_declared_since: float | None = Field(None, description=NOT_DECLARED_SINCE)


class ModelInfo(BaseModel):
    """What the engine replicas serve. Fields of the other family are None."""

    version: str = Field(description="content hash of the model directory")
    model_dir: str
    device: str
    family: Literal["qwen3", "hstu"] = Field("qwen3", description="qwen3: semantic-ID decoder; hstu: ranker")
    architecture: str | None = Field(None, description="qwen3 family: the decoder's architecture, qwen3 or qwen2")
    serves: list[str] = Field(description="the request kinds (routes) this model answers")
    catalog_items: int
    catalog_version: str | None = Field(
        None, description="the catalog version this replica serves (hstu: its item index's)"
    )
    previous_catalog_version: str | None = Field(
        None, description="qwen3: the version served before it, kept built for a rollback (None: none)"
    )
    catalog_refused: str | None = Field(
        None, description="why the last catalog the user_config named was refused (the running one stays)"
    )
    catalog_declared: str | None = Field(None, description=f"qwen3: {CATALOG_DECLARED}")
    catalog_status: CatalogStatus | None = Field(
        None,
        description="qwen3: declared (serves the declared catalog), kept_running (refused a live change to it, serves "
        "the one before), refusing (none since its start: answers 503 catalog_not_served)",
    )
    catalog_not_declared_since: float | None = Field(None, description=NOT_DECLARED_SINCE)
    replica: str | None = Field(None, description="the replica that answered")
    replicas: list[ReplicaState] | None = Field(
        None, description="every running replica of this deployment heard from lately, with its catalog version"
    )
    execution: dict | None = Field(
        None,
        description="what differs by device as the replica runs it (genrec.engine.plan): attention kernel, compiled "
        "pieces, CUDA graphs, split-KV, selection, and what its start captured (passes, static buffer bytes, the "
        "graphs' device memory on CUDA, warm-up seconds)",
    )
    max_candidates: int = Field(description="candidates per score, recommend or rank request")
    levels: int | None = Field(None, description="qwen3: semantic-ID code length (the longest code's)")
    codes: int | None = Field(None, description="qwen3: distinct codes in the catalog (items may share one)")
    code_ending: str | None = Field(None, description="qwen3: what follows a code (sid_layout.json 'ending')")
    max_beam_width: int | None = Field(None, description="qwen3")
    max_prompt_tokens: int | None = Field(None, description="qwen3")
    max_candidate_len: int | None = Field(None, description="qwen3: tokens of one score or recommend candidate")
    user_dim: int | None = Field(None, description="qwen3: soft-token input size; None: the model has no projector")
    chat_template: bool | None = Field(
        None, description="qwen3: the model has a chat template, so a prompt may be given as `messages`"
    )
    tasks: list[str] | None = Field(None, description="hstu: the head's tasks (scores per candidate)")
    max_history_events: int | None = Field(None, description="hstu: events a history may hold")
    ranker: ModelInfo | None = Field(
        None, description="an app with a ranker: its model (POST /v1/rank and a two-stage /v1/recommend use it)"
    )


class ErrorDetail(BaseModel):
    field: str = Field(
        description="where the problem is: a field's path (`candidates[2]`, `history[0].timestamp`), or `body` "
        "for the body as a whole (not JSON, or not a JSON object)"
    )
    message: str


class ErrorBody(BaseModel):
    code: str = Field(
        description="invalid_request | unauthorized | unknown_user | not_served | overloaded | timeout | unavailable | "
        "catalog_not_served"
    )
    message: str
    details: list[ErrorDetail] = []
