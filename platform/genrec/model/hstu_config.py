"""The HSTU ranker's `config.json`: every modelling choice named, validated at load.

Input vocabularies and their reserved indices (the engine maps requests onto these):

* items: rows 0 .. num_items-1 of the item embedding table, all real items (nothing reserved: the model
  runs packed rows, never padded sequences, so it needs no padding item). The catalog maps item IDs to rows.
* actions: 0 .. num_actions-1 are real actions; `no_action` (= num_actions) is an event without an action
  and every candidate (its action is what the model predicts).
* time buckets (optional, num_time_buckets > 0): the log2 of an event's gap in seconds to the previous event
  (`time_buckets`), 0 .. num_time_buckets-1; `unknown_bucket` (= num_time_buckets) is the first event, an
  event without a timestamp, and by default a candidate. Event times are within ±genrec.api.MAX_TIMESTAMP_S
  (the API refuses others) and a gap is clamped to [0, MAX_GAP_S], so no history can overflow. A gap never
  changes once the event is in the history, so cached K/V stay exact.
* positions: history event j (0-based over the user's whole history) is position j; every candidate takes
  position T (the history length), so a candidate's output never depends on the other candidates. A history
  can therefore hold at most `max_history_events` = max_positions - 1 events.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from genrec.api import MAX_TIMESTAMP_S
from genrec.errors import ModelDirectoryError

HSTU_MODEL_TYPE = "genrec_hstu"


@dataclass(frozen=True)
class HSTUConfig:
    num_items: int  # item embedding rows
    hidden_size: int  # model dim
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int  # q/k and v dim per head
    attention_normalizer: float  # N in A = SiLU(q·kᵀ/√d) / N: a constant, so cached history parts just add
    max_positions: int  # learned absolute positions
    num_actions: int  # real actions; one more embedding row means "no action"
    tasks: tuple[str, ...]  # one logit per task from the head
    head_hidden: int  # width of the multi-task head's hidden layer
    num_time_buckets: int = 0  # 0: no per-event time feature
    layer_norm_eps: float = 1e-6

    def __post_init__(self):
        if isinstance(self.tasks, list):  # from JSON; frozen and hashable as a tuple
            object.__setattr__(self, "tasks", tuple(self.tasks))
        problem = next(_problems(self), None)
        if problem:
            raise ValueError(f"HSTU config: {problem}")

    @property
    def num_key_value_heads(self) -> int:
        """K/V heads (= attention heads): lets genrec's KVPool hold HSTU's per-layer K and V unchanged."""
        return self.num_attention_heads

    @property
    def no_action(self) -> int:
        return self.num_actions

    @property
    def unknown_bucket(self) -> int:
        return self.num_time_buckets

    @property
    def max_history_events(self) -> int:
        """History events that fit: positions 0 .. T-1, plus position T for the candidates."""
        return self.max_positions - 1

    def time_buckets(self, timestamps: Sequence[float | None], previous: float | None = None) -> list[int]:
        """Each event's gap bucket: floor(log2(1 + gap seconds)) capped at num_time_buckets - 1, where gap is
        to the event before it (`previous` is the timestamp of the last event already cached, when appending);
        `unknown_bucket` where either timestamp is missing. Total, never raising: clock skew (a negative gap)
        counts as 0, the gap is clamped to MAX_GAP_S, and a time that is not a number within ±MAX_TIMESTAMP_S
        (the API refuses those) counts as missing."""
        out = []
        previous = _seconds(previous)
        for t in timestamps:
            t = _seconds(t)
            if t is None or previous is None:
                out.append(self.unknown_bucket)
            else:
                gap = min(max(t - previous, 0.0), MAX_GAP_S)
                out.append(min(int(math.log2(1.0 + gap)), self.num_time_buckets - 1))
            previous = t
        return out

    def to_dict(self) -> dict:
        body = asdict(self)
        body["tasks"] = list(self.tasks)
        return {"model_type": HSTU_MODEL_TYPE, **body}

    @classmethod
    def from_dict(cls, raw: dict, path: Path | str = "config.json") -> HSTUConfig:
        """Unknown keys are ignored (like transformers' configs); a wrong model_type or a bad value is refused."""
        if not isinstance(raw, dict):
            raise ModelDirectoryError(path, f"config.json must be a JSON object, not {type(raw).__name__}")
        if raw.get("model_type") != HSTU_MODEL_TYPE:
            raise ModelDirectoryError(path, f"model_type is {raw.get('model_type')!r}, not {HSTU_MODEL_TYPE!r}")
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            raise ModelDirectoryError(path, f"config.json lacks {', '.join(missing)}")
        tasks = raw["tasks"]
        if not isinstance(tasks, list) or not all(isinstance(t, str) for t in tasks):
            raise ModelDirectoryError(path, f"tasks must be a list of task names, not {tasks!r}")
        fields = {k: raw[k] for k in (*_REQUIRED, *_OPTIONAL) if k in raw}
        fields["tasks"] = tuple(tasks)
        for key in ("attention_normalizer", "layer_norm_eps"):
            if isinstance(fields.get(key), int) and not isinstance(fields[key], bool):
                fields[key] = float(fields[key])
        try:
            return cls(**fields)
        except ValueError as err:
            raise ModelDirectoryError(path, str(err).removeprefix("HSTU config: ")) from None


# The largest gap of two valid event times (genrec.api.MAX_TIMESTAMP_S): a gap is clamped to it, so its bucket is
# always a finite log2 (what a valid history gets is unchanged by the clamp).
MAX_GAP_S = 2 * MAX_TIMESTAMP_S


def _seconds(t) -> float | None:
    """An event time as float seconds, or None: missing, or not a real number within ±MAX_TIMESTAMP_S (NaN
    included; compared before any conversion, so an integer beyond a float is None, not an OverflowError)."""
    if isinstance(t, bool) or not isinstance(t, numbers.Real) or not -MAX_TIMESTAMP_S <= t <= MAX_TIMESTAMP_S:
        return None
    return float(t)


_POSITIVE = ("num_items", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "head_hidden")
_REQUIRED = (*_POSITIVE, "attention_normalizer", "max_positions", "num_actions", "tasks")
_OPTIONAL = ("num_time_buckets", "layer_norm_eps")


def _problems(c: HSTUConfig):
    """Why a config cannot be served."""

    def is_int(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    for name in _POSITIVE:
        if not is_int(getattr(c, name)) or getattr(c, name) < 1:
            yield f"{name} must be a positive integer, not {getattr(c, name)!r}"
    for name in ("num_actions", "num_time_buckets"):
        if not is_int(getattr(c, name)) or getattr(c, name) < 0:
            yield f"{name} must be a non-negative integer, not {getattr(c, name)!r}"
    if not is_int(c.max_positions) or c.max_positions < 2:
        yield f"max_positions must be an integer of at least 2 (one event plus the candidates), not {c.max_positions!r}"
    for name in ("attention_normalizer", "layer_norm_eps"):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
            yield f"{name} must be a positive number, not {value!r}"
    if not isinstance(c.tasks, tuple) or not c.tasks or not all(isinstance(t, str) and t for t in c.tasks):
        yield f"tasks must be one or more non-empty names, not {list(c.tasks)!r}"
    elif len(set(c.tasks)) != len(c.tasks):
        yield f"tasks must be distinct, not {list(c.tasks)!r}"
