"""The subset of a Hugging Face Qwen3 or Qwen2 `config.json` that our forward pass needs, validated.

The two decoder architectures the semantic-ID family runs are one implementation (model/qwen3.py), configured.

Qwen3 (OpenOneRec's base) and Qwen2 (Qwen2.5: MiniOneRec's base) differ in attention only: Qwen3 normalises each
query and key head (RMSNorm) before RoPE; Qwen2 has no such norm and adds biases to the q, k and v projections.
Everything else (RMSNorm, SwiGLU MLP, RoPE, grouped-query attention, a tied or untied head) is the same, so an
architecture is a few switches, read once when the model is built.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

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
        if not isinstance(raw, dict):
            raise ModelDirectoryError(path, f"config.json must be a JSON object, not {type(raw).__name__}")
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
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            raise ModelDirectoryError(path, f"config.json lacks {', '.join(missing)}")
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


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


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
