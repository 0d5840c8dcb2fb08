"""The subset of a Hugging Face Qwen3 `config.json` that our forward pass needs, validated."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from genrec.errors import ModelDirectoryError


@dataclass(frozen=True)
class Qwen3Config:
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

    @property
    def gqa_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def to_hf_dict(self) -> dict:
        """A config.json body that transformers (v4 and v5) and vLLM read as Qwen3."""
        body = asdict(self)
        body.update(
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            hidden_act="silu",
            use_sliding_window=False,
            attention_dropout=0.0,
            initializer_range=0.02,
            torch_dtype="float32",
            rope_scaling=None,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
        )
        return body

    @classmethod
    def from_file(cls, path: Path) -> Qwen3Config:
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelDirectoryError(path, "config.json is missing") from None
        except json.JSONDecodeError as err:
            raise ModelDirectoryError(path, f"config.json is not valid JSON ({err})") from None
        return cls.from_dict(raw, path)

    @classmethod
    def from_dict(cls, raw: dict, path: Path | str = "config.json") -> Qwen3Config:
        if raw.get("model_type") != "qwen3":
            raise ModelDirectoryError(path, f"model_type is {raw.get('model_type')!r}, genrec serves 'qwen3' only")
        if raw.get("use_sliding_window"):
            raise ModelDirectoryError(path, "sliding-window attention is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelDirectoryError(path, f"hidden_act {raw.get('hidden_act')!r} is not supported (silu only)")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelDirectoryError(path, f"rope type {rope_type!r} is not supported (default only)")
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0))
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
            if k not in raw
        ]
        if missing:
            raise ModelDirectoryError(path, f"config.json lacks {', '.join(missing)}")
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ModelDirectoryError(path, f"num_attention_heads {heads} is not a multiple of kv heads {kv_heads}")
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
        )
