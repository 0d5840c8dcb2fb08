"""Request and response models shared by the engine, Ray Serve, Ray Data jobs and the CLI.

Request fields are strictly typed, the same from Python objects and from JSON: no bool where a number is
expected, no string or float (not even 2.0) where an integer is, no bytes for text. JSON integers are
accepted for floats, JSON lists for tuples, NumPy arrays and scalars (Ray Data batches) by their values.
Text must be valid Unicode (a lone surrogate, reachable through JSON escapes, is refused).
"""

from __future__ import annotations

import math
import types
import typing
from typing import Annotated, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

MAX_BEAM_WIDTH = 1024
# The request kinds (routes) each model family answers: a Qwen3 semantic-ID decoder, an HSTU ranker.
FAMILY_KINDS = {"qwen3": ("retrieve", "score", "recommend"), "hstu": ("rank",)}
CATALOG_VERSION = "the catalog version that answered: a content hash of its file (genrec catalog add prints it)"
MAX_SCORE_WEIGHT = 1000.0  # far beyond it the joint order is the label's anyway, and the keys would overflow


def _plain(value):
    """NumPy arrays and scalars as Python values; their element types are then checked strictly."""
    return value.tolist() if isinstance(value, np.ndarray | np.generic) else value


def _unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"is not valid Unicode text (a lone surrogate at position {err.start})") from None
    return value


Text = Annotated[StrictStr, AfterValidator(_unicode)]
Int = Annotated[StrictInt, BeforeValidator(_plain)]
Float = Annotated[StrictFloat, AllowInfNan(False), BeforeValidator(_plain)]  # finite; an integer is taken too
Switch = Annotated[StrictBool, BeforeValidator(_plain)]
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], BeforeValidator(_plain)]
Vector = Annotated[list[StrictFloat], BeforeValidator(_plain)]
# Prefix-cache isolation (genrec.engine.prefix_cache): who may reuse a request's cached context, and how much of
# it is public. Every request kind has both fields. The length is checked before Text's own checks, so that its
# message speaks of characters.
CacheScope = Annotated[StrictStr, Field(min_length=1, max_length=256), *Text.__metadata__]
CACHE_SCOPE = (
    "who may reuse this request's cached context: requests of the same scope only (e.g. a tenant). None: no other "
    "request (over HTTP: the user's scope when user_id is given)"
)
SHARED_PREFIX = (
    "the first N context tokens (a rank request: history events) are public: requests of any scope may reuse "
    "them, e.g. a template every prompt opens with"
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def field_error(model: BaseModel, field: str | tuple[str | int, ...], problem: str) -> ValidationError:
    """A check across fields, as an error located at the field it is about (a ValueError from a model validator
    would be located at the model itself); raise it from the validator. `field`: a name, or a path of names and
    list positions (`("candidates", 2)`: candidates[2])."""
    loc = field if isinstance(field, tuple) else (field,)
    kind = PydanticCustomError("invalid", "{problem}", {"problem": problem})
    detail = InitErrorDetails(type=kind, loc=loc, input=getattr(model, loc[0], None))
    return ValidationError.from_exception_data(type(model).__name__, [detail])


# Pydantic's error types in genrec's words (`error_message`); a type not here keeps pydantic's message.
_WORDS = {
    "missing": "is required",
    "extra_forbidden": "is not a field of this request",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "string_type": "must be text (a string)",
    "list_type": "must be a list",
    "tuple_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "greater_than_equal": "must be at least {ge}",
    "greater_than": "must be above {gt}",
    "less_than_equal": "must be at most {le}",
    "less_than": "must be below {lt}",
    "literal_error": "must be {expected}",
}


# A value of the wrong type is told what it must be and what it was (`must be a list; got null`).
_TYPE_ERRORS = frozenset(
    ("int_type", "int_parsing", "float_type", "float_parsing", "bool_type", "string_type", "list_type")
    + ("tuple_type", "dict_type", "model_type", "model_attributes_type")
)
# What a value of each request model (pydantic names it by its class) must be, and what several of them are called.
_OBJECTS = {
    "Candidate": ("an object with item_id, text or token_ids", "objects with item_id, text or token_ids"),
    "Event": ("an object with item_id (and action, timestamp)", "events"),
    "ChatMessage": ("an object with role and content", "chat messages"),
}


def described_value(value) -> str:
    """What a value is, in the words of a JSON document (`null`, `a string`...), never the value itself."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and not _fits_a_float(value):  # JSON allows it; no float holds it
        return "a number too large for a float"
    kinds = ((int | float, "a number"), (str, "a string"), (list | tuple, "a list"), (dict, "an object"))
    return next((name for kind, name in kinds if isinstance(value, kind)), f"a value of type {type(value).__name__}")


def _fits_a_float(value: int) -> bool:
    try:
        float(value)
    except OverflowError:
        return False
    return True


def expected_value(model: type[BaseModel], name: str) -> str | None:
    """What field `name` of `model` takes, for a message (`a list of events`); None: not a field told here."""
    field = model.model_fields.get(name)
    annotation = _bare(field.annotation) if field is not None else None
    if typing.get_origin(annotation) is not list:
        return None
    (item,) = typing.get_args(annotation) or (None,)
    item = _bare(item)
    if isinstance(item, type) and item.__name__ in _OBJECTS:
        return f"a list of {_OBJECTS[item.__name__][1]}"
    words = {str: "strings", int: "integers", float: "numbers"}
    return f"a list of {words[item]}" if item in words else "a list"


def error_message(error: dict) -> str:
    """One pydantic error (an item of `ValidationError.errors()`) in genrec's words, without the field; a value of
    the wrong type also says what it was (`must be an object with item_id, text or token_ids; got null`)."""
    message = _message(error)
    if error.get("type") in _TYPE_ERRORS and "input" in error:
        message += f"; got {described_value(error['input'])}"
    return message


def located_error(error: dict, model: type[BaseModel] | None = None) -> tuple[str | None, str]:
    """One pydantic error as (its field's path, e.g. `candidates[0].text`: None when it names no field, as a check
    across fields located at the model; what is wrong with it, `error_message`). A dict key's error names the key.
    Pydantic's own parts of a location (a union member's schema, e.g. `function-after[...]`) are left out.
    `model`: the request model validated, which tells the object a location takes where the error does not (JSON
    validation does not name it)."""
    loc, kind = tuple(error.get("loc", ())), error.get("type")
    ctx = error.get("ctx") or {}
    if kind in ("model_type", "model_attributes_type") and "class_name" not in ctx and model:
        found = _model_at(model, loc)
        if found is not None:
            error = {**error, "ctx": {**ctx, "class_name": found.__name__}}
    message = error_message(error)
    if kind == "list_type" and model and loc and isinstance(loc[-1], str):  # `must be a list of events; ...`
        parent = _model_at(model, loc[:-1])
        expected = expected_value(parent, loc[-1]) if parent is not None else None
        if expected is not None:
            message = message.replace(_WORDS["list_type"], f"must be {expected}", 1)
    if "[key]" in loc and loc.index("[key]") > 0:  # (..., the key, "[key]"): the key is at fault, not its value
        at = loc.index("[key]")
        loc, message = loc[: at - 1], f"key {loc[at - 1]!r}: {message}"
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier():
            path += f".{part}" if path else part
    return path or None, message


def _model_at(model: type[BaseModel], loc: tuple) -> type | None:
    """The model class a location within `model` takes (`("candidates", 0)` of ScoreRequest: Candidate)."""
    at = model
    for part in loc:
        if isinstance(part, str) and isinstance(at, type) and issubclass(at, BaseModel) and part in at.model_fields:
            at = _bare(at.model_fields[part].annotation)
        elif isinstance(part, int) and typing.get_origin(at) is list:
            at = _bare(typing.get_args(at)[0])
        else:
            return None
    return at if isinstance(at, type) and issubclass(at, BaseModel) else None


def _bare(annotation):
    """An annotation without Annotated's metadata or an Optional's None (`list[Event] | None`: list[Event])."""
    while True:
        if typing.get_origin(annotation) is Annotated:
            annotation = typing.get_args(annotation)[0]
            continue
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(members) == 1:
            annotation = members[0]
            continue
        return annotation


def _message(error: dict) -> str:
    kind, ctx = error.get("type", ""), error.get("ctx") or {}
    if kind in ("model_type", "model_attributes_type") and ctx.get("class_name") in _OBJECTS:
        return f"must be {_OBJECTS[ctx['class_name']][0]}"
    if kind in ("value_error", "assertion_error") and "error" in ctx:
        return str(ctx["error"])
    unit = "characters" if kind.startswith("string") or isinstance(error.get("input"), str) else "items"
    if kind in ("too_short", "string_too_short"):
        least = ctx.get("min_length", 1)
        return "must not be empty" if least == 1 else f"must have at least {least} {unit}"
    if kind in ("too_long", "string_too_long") and "max_length" in ctx:
        return f"must have at most {ctx['max_length']} {unit}"
    if kind in _WORDS:
        try:
            return _WORDS[kind].format(**ctx)
        except (KeyError, IndexError):
            pass
    return str(error.get("msg", "invalid")).removeprefix("Value error, ")


class ChatMessage(_Strict):
    """One chat message, rendered with the others by the model's own chat template."""

    role: Annotated[Text, Field(min_length=1, max_length=64)]
    content: Text


# A prompt's forms: exactly one per request.
PROMPT_FORMS = ("prompt", "messages", "prompt_token_ids")


class PromptForms(_Strict):
    """A prompt as raw text (`prompt`), as chat messages (`messages`, rendered by the model's chat template with
    its system prompt and options, the assistant's turn opened) or as token IDs (`prompt_token_ids`): exactly
    one. The soft-token placeholder `<|user|>` may appear in any form (as its token ID in `prompt_token_ids`)."""

    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: TokenIds | None = None

    @model_validator(mode="after")
    def _one_prompt(self):
        given = [name for name in PROMPT_FORMS if getattr(self, name) is not None]
        if not given:
            raise field_error(
                self, "prompt", "give exactly one of 'prompt' (text), 'messages' (chat) or 'prompt_token_ids'"
            )
        if len(given) > 1:  # located at the first form given (a batch job's error row names it); quotes them all
            both = " and ".join(f"'{name}'" for name in given)
            problem = f"{both} were given: give exactly one prompt form (text, chat messages or token IDs)"
            raise field_error(self, given[0], problem)
        if self.prompt is not None and not self.prompt.strip():
            raise field_error(self, "prompt", "'prompt' is empty")
        if self.messages is not None and not self.messages:
            raise field_error(self, "messages", "'messages' is empty")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise field_error(self, "prompt_token_ids", "'prompt_token_ids' is empty")
        return self

    @property
    def prompt_form(self) -> str:
        """The form this request's prompt is given in: one of PROMPT_FORMS."""
        return next(name for name in PROMPT_FORMS if getattr(self, name) is not None)


class PromptRequest(PromptForms):
    """POST /v1/prompt, `Engine.render_prompt`: a prompt in any form, rendered as the engine would run it."""

    request_id: Annotated[Text, Field(max_length=256)] | None = None


class PromptResult(BaseModel):
    request_id: str | None = None
    form: Literal["prompt", "messages", "prompt_token_ids"] = Field(description="the form the prompt was given in")
    text: str = Field(description="the prompt as text: the rendered chat, the text given, or the token IDs decoded")
    token_ids: list[int] = Field(description="what the engine runs (and the prefix cache keys)")
    prompt_tokens: int
    user_placeholders: int = Field(description="<|user|> placeholder tokens: where a user_embedding would go")
    begin_token_appended: bool = Field(
        False,
        description="retrieve and recommend append the model's code begin token (e.g. <|sid_begin|>) after these "
        "tokens, which do not end with it (genrec/sid_layout.json 'begin')",
    )


class PromptInput(PromptForms):
    """A prompt (`PromptForms`) with an optional soft-token user vector and the request's cache fields.

    `user_embedding` replaces the embedding of every `<|user|>` placeholder in the prompt with
    `weight @ user_embedding + bias` (one vector for all placeholders of the prompt).
    """

    user_embedding: Vector | None = None
    request_id: Annotated[Text, Field(max_length=256)] | None = None
    cache_scope: CacheScope | None = Field(None, description=CACHE_SCOPE)
    shared_prefix: Int = Field(0, ge=0, description=SHARED_PREFIX)

    @field_validator("user_embedding")
    @classmethod
    def _finite(cls, value):
        if value is not None:
            if not value:
                raise ValueError("'user_embedding' is empty")
            if not all(math.isfinite(x) for x in value):
                raise ValueError("'user_embedding' has a non-finite value (NaN or infinity)")
        return value


# Per-request filters (genrec.catalog.filters compiles them against the catalog's attribute columns). A condition
# is checked by one validator, so that a refusal names the attribute and says what is wrong in one message.
RANGE_BOUNDS = ("gte", "gt", "lte", "lt")
SCALAR_JSON = {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}]}


def _filter_value(value, where: str = ""):
    """A value to compare with: text, a finite number or a boolean (NumPy scalars by value)."""
    value = _plain(value)
    if isinstance(value, str):
        return _unicode(value)
    if isinstance(value, bool | int) or (isinstance(value, float) and math.isfinite(value)):
        return value
    shown = "null" if value is None else repr(value)  # as JSON says it
    raise ValueError(f"{where}must be text, a finite number or true/false, not {shown}"[:200])


class FilterRange(_Strict):
    """A range condition: numbers, or ISO-8601 times for a timestamp column; at least one bound."""

    gte: str | int | float | None = None
    gt: str | int | float | None = None
    lte: str | int | float | None = None
    lt: str | int | float | None = None


def _filter_condition(value):
    """One attribute's condition: a value (equality), a non-empty list (any of) or a range {gte|gt|lte|lt: v}."""
    value = _plain(value)
    if isinstance(value, FilterRange):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(RANGE_BOUNDS), key=str)
        if unknown:
            raise ValueError(f"a range takes gte, gt, lte and lt, not {unknown[0]!r}")
        bounds = {b: _filter_value(v, f"bound {b!r} ") for b, v in value.items() if v is not None}
        if not bounds:
            raise ValueError("a range needs at least one of gte, gt, lte, lt")
        return FilterRange(**bounds)
    if isinstance(value, list | tuple):
        if not value:
            raise ValueError("an empty list of values: give at least one")
        return [_filter_value(v, f"value [{k}] ") for k, v in enumerate(value)]
    return _filter_value(value)


FilterCondition = Annotated[
    object,
    BeforeValidator(_filter_condition),
    WithJsonSchema(
        {
            "anyOf": [
                *SCALAR_JSON["anyOf"],
                {"type": "array", "items": SCALAR_JSON, "minItems": 1},
                {"type": "object", "properties": {b: SCALAR_JSON for b in RANGE_BOUNDS}, "additionalProperties": False},
            ]
        }
    ),
]
FILTERS_HELP = (
    "conditions on the catalog's item attributes, all of which an item must meet: {attr: value} equality (a "
    "list-valued attribute: contains it), {attr: [v, ...]} any of, {attr: {gte|gt|lte|lt: v}} a range (numbers; "
    "ISO-8601 times for timestamp columns); the key 'available_at' (an ISO-8601 time t) keeps the items with "
    "available_from <= t < available_until (a null bound is open). Only allowed items ever take a beam"
)
ALLOWED_HELP = "only these catalog items may be returned or scored (and the filters' conditions); [] allows none"


class Filtered(_Strict):
    """The per-request filter fields of the request kinds that read the catalog (retrieve, recommend, score)."""

    filters: dict[Annotated[Text, Field(min_length=1)], FilterCondition] | None = Field(None, description=FILTERS_HELP)
    allowed_item_ids: list[Text] | None = Field(None, description=ALLOWED_HELP)

    @property
    def filtered(self) -> bool:
        return self.filters is not None or self.allowed_item_ids is not None


BEAM_WIDTHS_HELP = (
    "a beam width per code level (one per token of the catalog's longest code): the best beam_widths[l] partial "
    "codes are kept after level l; ending steps (e.g. <|sid_end|>) keep the last width. None: beam_width at "
    "every level. beam_width, when given too, must equal the last width"
)


NUM_RESULTS_HELP = (
    "codes whose items are returned (default and at most: beam_width). Results are items, beams are codes: the "
    "result holds every item of the best num_results codes, a code several items share giving them all, adjacent "
    "(so more items than num_results where codes are shared; `codes` says how many). A two-stage recommend's "
    "ranker orders items, not codes: its answer is cut to num_results items"
)


class RetrieveRequest(PromptInput, Filtered):
    beam_width: Int = Field(
        30, ge=1, le=MAX_BEAM_WIDTH, description="codes kept at the last level: the beams the results come from"
    )
    beam_widths: list[Annotated[Int, Field(ge=1, le=MAX_BEAM_WIDTH)]] | None = Field(
        None, min_length=1, description=BEAM_WIDTHS_HELP
    )
    num_results: Int | None = Field(None, ge=1, description=NUM_RESULTS_HELP)
    exclude_item_ids: list[Text] = Field(default_factory=list)

    @model_validator(mode="after")
    def _results_within_beam(self):
        if self.beam_widths is not None:
            last = self.beam_widths[-1]
            if "beam_width" in self.model_fields_set and self.beam_width != last:
                problem = f"{self.beam_width} differs from the last of beam_widths ({last}): give one, or the same"
                raise field_error(self, "beam_width", problem)
            self.beam_width = last
        if self.num_results is None:
            self.num_results = self.beam_width
        if self.num_results > self.beam_width:
            problem = f"{self.num_results} is above beam_width ({self.beam_width}): the results come from its beams"
            raise field_error(self, "num_results", problem)
        return self


class RetrievedItem(BaseModel):
    item_id: str
    semantic_id: list[int]
    logprob: float


class RetrieveResult(BaseModel):
    request_id: str | None = None
    items: list[RetrievedItem]
    codes: int | None = Field(
        None, description="distinct codes the items came from (several items may share one code: adjacent)"
    )
    prompt_tokens: int
    unknown_exclusions: int = Field(0, description="exclude_item_ids not in the catalog (ignored)")
    catalog_version: str | None = Field(None, description=CATALOG_VERSION)


class Candidate(_Strict):
    """One candidate to score: a catalog item (scored by its semantic-ID tokens), token IDs, or text."""

    item_id: Text | None = None
    token_ids: TokenIds | None = None
    text: Text | None = None

    @model_validator(mode="after")
    def _one_form(self):
        given = [name for name in ("item_id", "token_ids", "text") if getattr(self, name) is not None]
        if len(given) != 1:
            problem = f"a candidate needs exactly one of item_id, token_ids, text (got {given or 'none'})"
            raise field_error(self, given[1] if given else "item_id", problem)
        if self.text is not None and not self.text.strip():
            raise field_error(self, "text", "candidate 'text' is empty")
        if self.token_ids is not None and not self.token_ids:
            raise field_error(self, "token_ids", "candidate 'token_ids' is empty")
        if self.item_id is not None and not self.item_id:
            raise field_error(self, "item_id", "candidate 'item_id' is empty")
        return self


LABELS_HELP = "(positive, negative) label tokens; default: the model's (genrec/sid_layout.json 'labels', else yes/no)"


def _two_labels(value):
    """A list of labels of another length than two, refused naming `labels` with the count (a tuple's own check
    names the first missing position, `labels[1]`, as if the field were that item)."""
    value = _plain(value)
    if isinstance(value, list | tuple) and len(value) != 2:
        raise ValueError(f"needs 2 labels, the positive then the negative; got {len(value)}")
    return value


Labels = Annotated[tuple[Text, Text], BeforeValidator(_two_labels)]


class ScoreRequest(PromptInput, Filtered):
    candidates: list[Candidate] = Field(min_length=1)
    labels: Labels | None = Field(None, description=LABELS_HELP)


class CandidateScore(BaseModel):
    item_id: str | None = None
    logprob: float = Field(description="full-vocabulary log-softmax of the positive label after the candidate")
    prob: float = Field(description="softmax over the two labels only: P(positive)")


class ScoreResult(BaseModel):
    request_id: str | None = None
    scores: list[CandidateScore] = Field(description="in the candidates' order, less those the filters do not allow")
    filtered_out: int = Field(0, description="candidates left out because the request's filters do not allow them")
    prompt_tokens: int
    catalog_version: str | None = Field(None, description=CATALOG_VERSION)


class RecommendRequest(RetrieveRequest):
    """Retrieve by beam search, then score the retrieved items (plus any given candidates) on the same prefill.

    Excluded means excluded: a given candidate whose item_id is in `exclude_item_ids` is dropped (it is neither
    scored nor returned). One row per item: an item both retrieved and given is scored once and returned once,
    with source "retrieved+given"; a given item_id repeated is kept once. Text and token candidates have no
    item identity and are each kept.
    """

    candidates: list[Candidate] = Field(default_factory=list)
    labels: Labels | None = Field(None, description=LABELS_HELP)
    rank_by: Literal["score", "joint", "beam"] = Field(
        "score",
        description="'score': by score_logprob, log P(positive label | prompt, item). 'joint': by "
        "code_logprob + score_weight * score_logprob, the generator's and the label's evidence together (at "
        "weight 1, log P(item, positive label | prompt)); for a label head trained beside the generator. 'beam': "
        "no label scored (score_logprob and prob None): the retrieved items in beam order, then the given "
        "candidates kept (catalog items only), in their order; what a later stage ranks (a two-stage recommend's "
        "first)",
    )
    score_weight: Annotated[Float, Field(ge=0, le=MAX_SCORE_WEIGHT)] = Field(
        1.0, description="rank_by='joint': the weight of score_logprob (0 keeps the generator's order)"
    )

    @model_validator(mode="after")
    def _weight_with_joint(self):
        if self.score_weight != 1.0 and self.rank_by != "joint":
            raise field_error(self, "score_weight", "'score_weight' applies to rank_by 'joint' only")
        return self

    @model_validator(mode="after")
    def _items_in_beam_order(self):
        """rank_by 'beam' scores nothing: no label to give, and a given candidate must be an item to return."""
        if self.rank_by != "beam":
            return self
        if self.labels is not None:
            raise field_error(self, "labels", "rank_by 'beam' scores no label: leave labels out")
        for i, candidate in enumerate(self.candidates):
            if candidate.item_id is None:
                problem = "rank_by 'beam' returns catalog items: give candidates as item_id, not text or tokens"
                raise field_error(self, ("candidates", i), problem)
        return self


class RecommendedItem(BaseModel):
    item_id: str | None = None
    semantic_id: list[int] | None = None
    retrieval_logprob: float | None = Field(None, description="beam-search logprob; None for given candidates")
    code_logprob: float | None = Field(
        None,
        description="log P(item's tokens | prompt): the beam logprob of a retrieved item; for a given "
        "candidate computed in the scoring pass under rank_by='joint', else None",
    )
    score_logprob: float | None = Field(
        None,
        description="log P(positive label | prompt, item); None under rank_by 'beam', as in a two-stage recommend "
        "(the ranker orders it)",
    )
    prob: float | None = Field(None, description="P(positive | either label); None where score_logprob is")
    source: str = Field(description="'retrieved', 'given', or 'retrieved+given' (retrieved and also given)")
    ranker_scores: dict[str, float] | None = Field(
        None,
        description="two-stage recommend (a `history` sent to an app with a ranker): the ranker's probability per "
        "task; None when the item was not ranked (unknown to the ranker's catalog), or without a ranking stage",
    )

    @classmethod
    def retrieved(cls, item: RetrievedItem, given: set[str], **scores) -> RecommendedItem:
        """A retrieved item as recommend returns it: its beam logprob is its code logprob, its source
        "retrieved+given" when it was also among the `given` item IDs; `scores`: score_logprob and prob."""
        source = "retrieved+given" if item.item_id in given else "retrieved"
        return cls(
            item_id=item.item_id,
            semantic_id=item.semantic_id,
            retrieval_logprob=item.logprob,
            code_logprob=item.logprob,
            source=source,
            **scores,
        )


class RecommendResult(BaseModel):
    request_id: str | None = None
    items: list[RecommendedItem] = Field(
        description="ranked by the request's rank_by, best first; two-stage: by the ranker's rank_task probability"
    )
    prompt_tokens: int
    unknown_exclusions: int = 0
    catalog_version: str | None = Field(None, description=CATALOG_VERSION)
    rank_task: str | None = Field(None, description="two-stage: the ranker's task the items are ordered by")
    ranker_version: str | None = Field(None, description="two-stage: the ranking model's version")
    degraded: bool = Field(
        False,
        description="two-stage: the ranking failed, and the items are the retrieval's in beam order (given "
        "candidates after), unranked",
    )
    degraded_reason: str | None = Field(
        None, description="why, when degraded: ranker_unavailable, ranker_overloaded, ranker_timeout or ranker_error"
    )


# -- ranking (the HSTU family): a user's event history, then candidates scored per task -----------------------

Timestamp = Annotated[StrictFloat | StrictInt, BeforeValidator(_plain)]
# An event time's bound, in seconds either side of its epoch (~31,700 years). Any two times within it differ by a
# finite float64, so no history's gaps can overflow; and epoch milliseconds of today (1.7e12) are refused, not read
# as seconds 1000 times too far apart.
MAX_TIMESTAMP_S = 1e12


class Event(_Strict):
    """One event of a user's history, oldest first: the item, what the user did (an action index of the model;
    None: no action recorded) and when (seconds, any epoch, within ±MAX_TIMESTAMP_S; None: unknown)."""

    item_id: Text
    action: Int | None = Field(None, ge=0)
    timestamp: Timestamp | None = None

    @field_validator("timestamp")
    @classmethod
    def _bounded_time(cls, value):
        # Compared, never converted: a JSON integer beyond a float compares exactly (float() would overflow).
        if value is None or -MAX_TIMESTAMP_S <= value <= MAX_TIMESTAMP_S:
            return value
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("'timestamp' is not a finite number")
        raise ValueError(
            f"'timestamp' is beyond ±{MAX_TIMESTAMP_S:.0e} seconds (epoch milliseconds? send seconds: divide by 1000)"
        )


UNKNOWN_CANDIDATES_HELP = (
    "a candidate the ranker's catalog does not hold: 'refuse' it (a 422 naming it), or 'skip' it (left out of the "
    "result; the history is checked all the same). Skipping all of them is no error: the result has no item. The "
    "funnel's ranking stage skips (the two models' catalogs may differ)"
)


class RankRequest(_Strict):
    history: list[Event] = Field(min_length=1, description="the user's events, oldest first")
    candidates: list[Text] = Field(min_length=1, description="item IDs to rank after the history")
    tasks: list[Text] | None = Field(None, min_length=1, description="the model's tasks to return (default: all)")
    request_id: Annotated[Text, Field(max_length=256)] | None = None
    cache_scope: CacheScope | None = Field(None, description=CACHE_SCOPE)
    shared_prefix: Int = Field(0, ge=0, description=SHARED_PREFIX)
    unknown_candidates: Literal["refuse", "skip"] = Field("refuse", description=UNKNOWN_CANDIDATES_HELP)


class RankedItem(BaseModel):
    item_id: str
    scores: dict[str, float] = Field(description="task name -> probability")


class RankResult(BaseModel):
    request_id: str | None = None
    items: list[RankedItem] = Field(description="in the candidates' order")
    history_events: int
    catalog_version: str | None = Field(None, description="the ranker's item index (a content hash of its file)")
