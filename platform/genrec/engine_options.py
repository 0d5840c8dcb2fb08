"""How an Engine is built: the options a Serve config's engine sections and a batch job's spec share."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from genrec.api import Int, Switch

# Options no longer taken, and what a config that names one does instead.
REMOVED = {
    "cuda_graph_selection": "the decode graphs' own selection is internal until a GPU has timed it (gpu_check's "
    "fast_selecting); leave it out",
}

# A decoder's own options (its FP8 linear layers, decode's split-KV, prefill's attention kernel): HSTU has none.
DECODER_OPTIONS = ("fp8", "split_kv", "attention")
ON_HSTU = "is a Qwen3 decoder's option, and {model} is an HSTU model; leave it out"


class EngineOptions(BaseModel):
    """`Engine.from_pretrained`'s options. They can change results (numerics, which requests are refused), so
    a batch run keeps them in its identity."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _refuse_removed(cls, values):
        """A removed option is refused with one line naming what replaced it (docs/CHANGELOG.md)."""
        for name, instead in REMOVED.items():
            if isinstance(values, dict) and name in values:
                raise ValueError(f"{name} was removed: {instead}")
        return values

    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="default: bfloat16 on CUDA, float32 on the CPU"
    )
    max_candidates: Int = Field(2048, ge=1, description="candidates per score or recommend request")
    score_max_tokens: Int = Field(
        16384,
        ge=1,
        description="one scoring or ranking pass's estimated cost, in token-equivalents (padded tokens plus their "
        "attention; docs/engine.md)",
    )
    max_candidate_tokens: Int = Field(65536, ge=1, description="candidate tokens of one request in all; beyond: 4xx")
    max_candidate_len: Int | None = Field(
        None,
        ge=1,
        description="tokens of one score or recommend candidate; beyond: 4xx (default: the longest candidate one "
        "scoring pass holds)",
    )
    cuda_fast: Switch | None = Field(
        None,
        description="the CUDA fast path (FlashAttention-2 varlen, decode passes replayed as CUDA graphs captured at "
        "start); default: on with CUDA, false opts out; no effect on the CPU",
    )
    cuda_graph_max_rows: Int | None = Field(
        None,
        ge=16,
        le=16384,
        description="rows of the largest decode pass captured as a CUDA graph at start (default: worked out at start "
        "from max_running, the widest beam, the KV pool and the memory left beside it; genrec.engine.capture_size)",
    )
    split_kv: Literal["off", "on", "auto"] | None = Field(
        None,
        description="CUDA decode: cut each long context into chunks read in parallel when a pass would leave most SMs "
        "idle (auto, the default), always (on) or never (off); the results are the same (genrec.engine.plan)",
    )
    attention: Literal["auto", "flash_attention_2", "cudnn_attention", "flash_attention_3"] | None = Field(
        None,
        description="CUDA, half precision: a decoder's prefill attention kernel, measured at start on the device's "
        "own shapes and the fastest kept (auto, the default; cached per device and model shape), or the one named, "
        "refused where it does not run; decode's stays FlashAttention-2's; no effect on the CPU "
        "(genrec.attention.choice)",
    )
    fp8: Switch = Field(
        False,
        description="the decoder's linear layers in FP8 (e4m3 weights scaled per output channel at load, inputs per "
        "token; torch._scaled_mm): a GPU of compute capability 8.9 or later (H100, H200, L4); opt-in, its speed not "
        "yet measured; the LM head stays in the model's dtype (genrec.model.fp8)",
    )

    def decoder_option_set(self) -> str | None:
        """The first option set here that only a Qwen3 decoder takes (`DECODER_OPTIONS`), or None. On an HSTU model
        it would be taken and do nothing: a ranker's sections refuse it."""
        return next((name for name in DECODER_OPTIONS if getattr(self, name)), None)

    def engine_kwargs(self) -> dict:
        """`Engine.from_pretrained`'s kwargs; a derived default is left out, so a batch run's identity stays."""
        kwargs = self.model_dump(include=set(EngineOptions.model_fields))
        # Derived (by the other options or the device), or off: an unset one is not part of the identity.
        for name in ("max_candidate_len", "cuda_fast", "cuda_graph_max_rows", "split_kv", "attention"):
            if kwargs[name] is None:
                del kwargs[name]
        if not kwargs["fp8"]:  # off, the default: runs from before the option keep their identity
            del kwargs["fp8"]
        return kwargs
