"""The two families' `config.json`, validated: the semantic-ID decoder's (`Qwen3Config`, the subset of a Qwen3 or
Qwen2 config our forward pass needs; docs/engine.md, 'Two decoder architectures: Qwen3 and Qwen2') and the ranker's
(`HSTUConfig`, which names every modelling choice; docs/engine.md, 'Ranking after a history: HSTU').

HSTU's reserved indices: item rows 0 .. num_items-1 are all real items (packed rows need no padding item);
`no_action` (= num_actions) is an event without an action and every candidate (its action is what is predicted);
`unknown_bucket` (= num_time_buckets) is the first event, one without a timestamp, and by default a candidate.
History event j (0-based over the whole history) is position j; every candidate takes position T, the history length.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from genrec.api import MAX_TIMESTAMP_S
from genrec.errors import ModelDirectoryError


@dataclass(frozen=True)
class DecoderArchitecture:
    model_type: str  # config.json's model_type
    hf_class: str  # config.json's architectures[0]: the transformers class that is the numerical reference
    qk_norm: bool  # an RMSNorm over each query and key head before RoPE
    qkv_bias: bool  # biases on the q, k and v projections whatever config.json says
    reads_attention_bias: bool  # config.json's attention_bias applies (Qwen3: biases on q/k/v/o; Qwen2 ignores it)


QWEN3 = DecoderArchitecture("qwen3", "Qwen3ForCausalLM", qk_norm=True, qkv_bias=False, reads_attention_bias=True)
QWEN2 = DecoderArchitecture("qwen2", "Qwen2ForCausalLM", qk_norm=False, qkv_bias=True, reads_attention_bias=False)
ARCHITECTURES = {arch.model_type: arch for arch in (QWEN3, QWEN2)}


@dataclass(frozen=True)
class Qwen3Config:
    """The semantic-ID decoder's config; `architecture` (config.json's model_type) is qwen3 or qwen2."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    architecture: str = "qwen3"

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES)}, not {self.architecture!r}")

    @property
    def arch(self) -> DecoderArchitecture:
        return ARCHITECTURES[self.architecture]

    @property
    def qkv_bias(self) -> bool:
        """Whether the q, k and v projections have biases (Qwen2 always; Qwen3 with attention_bias)."""
        return self.arch.qkv_bias or self.attention_bias

    def to_hf_dict(self) -> dict:
        """A config.json body that transformers (v4 and v5) and vLLM read as Qwen3 (or Qwen2)."""
        body = asdict(self)
        del body["architecture"]
        if self.architecture == "qwen2":  # Qwen2.5's own keys: its window is off, as genrec requires
            del body["attention_bias"]
            body.update(sliding_window=self.max_position_embeddings, max_window_layers=self.num_hidden_layers)
        body.update(
            architectures=[self.arch.hf_class],
            model_type=self.arch.model_type,
            hidden_act="silu",
            use_sliding_window=False,
            attention_dropout=0.0,
            initializer_range=0.02,
            torch_dtype="float32",
            rope_scaling=None,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
        )
        return body

    def prompt_room(self, levels: int) -> int:
        """Positions left for a prompt once a `levels`-token code follows it: at least one, or the model is refused."""
        room = self.max_position_embeddings - levels
        if room < 1:
            raise ModelDirectoryError(
                "config.json",
                f"max_position_embeddings {self.max_position_embeddings} cannot hold a 1-token prompt plus a "
                f"{levels}-token semantic-ID code (needs at least {levels + 1})",
            )
        return room

    @classmethod
    def from_dict(cls, raw: dict, path: Path | str = "config.json") -> Qwen3Config:
        _json_object(raw, path)
        arch = ARCHITECTURES.get(raw.get("model_type"))
        if arch is None:
            raise ModelDirectoryError(
                path, f"model_type is {raw.get('model_type')!r}; genrec's decoders are {' and '.join(ARCHITECTURES)}"
            )
        _refuse_sliding_window(raw, path)
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelDirectoryError(path, f"hidden_act {raw.get('hidden_act')!r} is not supported (silu only)")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ModelDirectoryError(path, f"rope_parameters must be an object, not {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelDirectoryError(path, f"rope type {rope_type!r} is not supported (default only)")
        _require(raw, _QWEN3_REQUIRED, path)
        heads = _positive_int(raw, "num_attention_heads", path)
        kv_heads = _positive_int(raw, "num_key_value_heads", path, default=heads)
        if heads % kv_heads:
            raise ModelDirectoryError(path, f"num_attention_heads {heads} is not a multiple of kv heads {kv_heads}")
        head_dim = _positive_int(raw, "head_dim", path, default=_positive_int(raw, "hidden_size", path) // heads)
        if head_dim % 2:
            raise ModelDirectoryError(path, f"head_dim {head_dim} must be even (rotary embedding)")
        return cls(
            vocab_size=_positive_int(raw, "vocab_size", path),
            hidden_size=_positive_int(raw, "hidden_size", path),
            intermediate_size=_positive_int(raw, "intermediate_size", path),
            num_hidden_layers=_positive_int(raw, "num_hidden_layers", path),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive_float(raw, "rms_norm_eps", path, 1e-6),
            rope_theta=_positive_float(rope, "rope_theta", path, _positive_float(raw, "rope_theta", path, 1e6)),
            max_position_embeddings=_positive_int(raw, "max_position_embeddings", path, default=40960),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch.reads_attention_bias and bool(raw.get("attention_bias", False)),
            architecture=arch.model_type,
        )


def _refuse_sliding_window(raw: dict, path) -> None:
    """Full attention only: a window turned on (Qwen2's use_sliding_window) or a sliding layer is refused by name."""
    if raw.get("use_sliding_window"):
        raise ModelDirectoryError(
            path,
            f"use_sliding_window is true (sliding_window {raw.get('sliding_window')!r}, max_window_layers "
            f"{raw.get('max_window_layers')!r}): sliding-window attention is not supported, genrec runs full "
            "attention only",
        )
    layer_types = raw.get("layer_types") or []
    if not isinstance(layer_types, list):
        raise ModelDirectoryError(path, f"layer_types must be a list, not {layer_types!r}")
    sliding = [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
    if sliding:
        raise ModelDirectoryError(
            path,
            f"layer_types[{sliding[0]}] is {layer_types[sliding[0]]!r}: genrec runs full attention only "
            "('full_attention' in every layer)",
        )


def _json_object(raw, path) -> None:
    if not isinstance(raw, dict):
        raise ModelDirectoryError(path, f"config.json must be a JSON object, not {type(raw).__name__}")


def _require(raw: dict, keys, path) -> None:
    missing = [k for k in keys if k not in raw]
    if missing:
        raise ModelDirectoryError(path, f"config.json lacks {', '.join(missing)}")


_QWEN3_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _positive_int(raw: dict, key: str, path, default: int | None = None) -> int:
    value = raw.get(key) if raw.get(key) is not None else default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelDirectoryError(path, f"{key} must be a positive integer, not {value!r}")
    return value


def _positive_float(raw: dict, key: str, path, default: float) -> float:
    value = raw.get(key) if raw.get(key) is not None else default
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise ModelDirectoryError(path, f"{key} must be a positive number, not {value!r}")
    return float(value)


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
        """Each event's gap bucket (formula and clamps: docs/engine.md, 'Ranking after a history: HSTU'); `previous`
        is the last cached event's timestamp when appending. Never raises: a bad time counts as missing."""
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
        _json_object(raw, path)
        if raw.get("model_type") != HSTU_MODEL_TYPE:
            raise ModelDirectoryError(path, f"model_type is {raw.get('model_type')!r}, not {HSTU_MODEL_TYPE!r}")
        _require(raw, _HSTU_REQUIRED, path)
        tasks = raw["tasks"]
        if not isinstance(tasks, list) or not all(isinstance(t, str) for t in tasks):
            raise ModelDirectoryError(path, f"tasks must be a list of task names, not {tasks!r}")
        fields = {k: raw[k] for k in (*_HSTU_REQUIRED, *_HSTU_OPTIONAL) if k in raw}
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


_HSTU_POSITIVE = ("num_items", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "head_hidden")
_HSTU_REQUIRED = (*_HSTU_POSITIVE, "attention_normalizer", "max_positions", "num_actions", "tasks")
_HSTU_OPTIONAL = ("num_time_buckets", "layer_norm_eps")


def _problems(c: HSTUConfig):
    """Why a config cannot be served."""

    def is_int(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    for name in _HSTU_POSITIVE:
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


CONFIG_FILE = "config.json"
MAX_CONFIG_BYTES = 16 << 20  # a Hugging Face config.json is a few KB
FAMILY_NAMES = {"qwen3": "a Qwen3 semantic-ID model", "hstu": "an HSTU ranking model"}


def read_config(path: Path):
    """config.json's JSON; ModelDirectoryError names the file when it is missing, not a regular file (a FIFO would
    hang the reader), over MAX_CONFIG_BYTES, unreadable or not JSON."""
    try:
        if not path.is_file():
            raise ModelDirectoryError(path.parent, f"config.json is {'not a file' if path.exists() else 'missing'}")
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ModelDirectoryError(path, f"config.json is over {MAX_CONFIG_BYTES >> 20} MiB: not a model's config")
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise ModelDirectoryError(path, f"config.json cannot be read ({err})") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError, an integer too long, nesting too deep
        raise ModelDirectoryError(path, f"config.json is not valid JSON ({type(err).__name__}: {err})") from None


def family_of(raw) -> str:
    """The family a config.json names: an HSTU ranker by its model_type, else a Qwen3 decoder."""
    return "hstu" if isinstance(raw, dict) and raw.get("model_type") == HSTU_MODEL_TYPE else "qwen3"


def validated_config(raw, family: str, path: Path) -> Qwen3Config | HSTUConfig:
    """`raw` validated as `family`'s config (ModelDirectoryError names `path`). Without torch: `genrec deploy` checks a
    directory on a machine that may not have it."""
    return (HSTUConfig if family == "hstu" else Qwen3Config).from_dict(raw, path)
