"""Complete, deterministic model directories with random weights of the real architectures: Qwen3 (or Qwen2,
`ModelSpec(architecture="qwen2")`) and HSTU (layout: docs/engine.md, 'Ranking after a history: HSTU'), for tests and
benchmarks (no model hub is reachable). Qwen3 weights make next-token distributions peaked like a trained model's,
so beam-search tests are not decided by near-ties; HSTU weights keep hidden states O(1) through the layers and task
probabilities spread over (0, 1), so tests are not decided by saturated sigmoids.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from safetensors.torch import save
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from genrec.catalog.catalog import Catalog, parquet_bytes
from genrec.errors import ModelDirectoryError
from genrec.files import write_atomically
from genrec.model.config import ARCHITECTURES, HSTUConfig, Qwen3Config
from genrec.model.directory import GENREC_SUBDIR
from genrec.model.hstu import HSTU
from genrec.model.sid_layout import SidLayout
from genrec.model.soft_token import SoftTokenProjector
from genrec.model.tokenizer import EOS_TOKEN, LABEL_TOKENS, LEVEL_LETTERS, USER_TOKEN, semantic_token


@dataclass(frozen=True)
class ModelSpec:
    items: int = 500
    levels: int = 3
    codebook: int = 16
    user_dim: int = 16
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    vocab_size: int | None = None  # default: the tokenizer's size
    tie_word_embeddings: bool = False
    max_positions: int = 8192
    seed: int = 0
    architecture: str = "qwen3"  # or "qwen2": q/k/v biases, no q/k norm (config.json model_type qwen2)

    def __post_init__(self):
        problem = next(_spec_problems(self), None)
        if problem:
            raise ValueError(f"model spec: {problem}")


_MINIMUM = dict.fromkeys(("items", "levels", "codebook", "hidden", "layers", "heads", "kv_heads", "head_dim"), 1)
_MINIMUM.update(intermediate=1, user_dim=0, seed=0)


def _spec_problems(spec: ModelSpec):
    """Why a spec cannot be written or served (checked before anything is written)."""
    for name, low in _MINIMUM.items():
        if getattr(spec, name) < low:
            yield f"{name} must be at least {low}, not {getattr(spec, name)}"
    if spec.architecture not in ARCHITECTURES:
        yield f"architecture must be one of {sorted(ARCHITECTURES)}, not {spec.architecture!r}"
    if spec.levels > len(LEVEL_LETTERS):
        yield f"levels must be at most {len(LEVEL_LETTERS)} (one letter per level in token names), not {spec.levels}"
    if spec.architecture == "qwen2" and spec.heads * spec.head_dim != spec.hidden:
        # Qwen2 implementations that predate head_dim in its config take hidden / heads: all then read one model.
        yield f"a qwen2 model needs heads x head_dim = hidden, not {spec.heads} x {spec.head_dim} != {spec.hidden}"
    if spec.heads % spec.kv_heads:
        yield f"heads ({spec.heads}) must be a multiple of kv_heads ({spec.kv_heads})"
    if spec.head_dim % 2:
        yield f"head_dim must be even (rotary embedding), not {spec.head_dim}"
    if spec.max_positions <= spec.levels:
        yield f"max_positions {spec.max_positions} cannot hold a prompt token plus a {spec.levels}-token code"
    if spec.items > spec.codebook**spec.levels:
        yield (
            f"{spec.items} items do not fit in {spec.levels} levels of {spec.codebook} codes "
            f"({spec.codebook**spec.levels} codes)"
        )


PRESETS = {
    # Benchmark presets. "tiny" is the smallest model whose decode is not pure per-op latency on a CPU.
    "tiny": ModelSpec(
        items=2000, levels=5, codebook=16, hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=768
    ),
    # The shape the returning-users and HSTU goals are stated at (a CPU can run 2000-token prompts of it).
    "realistic": ModelSpec(
        items=5000, levels=5, codebook=32, hidden=512, layers=4, heads=8, kv_heads=4, head_dim=64, intermediate=1536
    ),
    "small": ModelSpec(
        items=5000, levels=5, codebook=32, hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, intermediate=1536
    ),
    "qwen3-1.7b": ModelSpec(
        items=20000,
        levels=3,
        codebook=256,
        user_dim=128,
        hidden=2048,
        layers=28,
        heads=16,
        kv_heads=8,
        head_dim=128,
        intermediate=6144,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_positions=40960,
    ),
}


def preset(name: str, **overrides) -> ModelSpec:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def make_room(out: Path, force: bool) -> None:
    """Let a new model directory be written at `out`: absent or empty is fine; an existing model directory is
    removed only with `force`; anything else is refused, so `--force` never deletes what is not a model."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ModelDirectoryError(out, "exists and is not a directory")
    if not any(out.iterdir()):
        return
    if not (out / "config.json").is_file():
        raise ModelDirectoryError(out, "exists, is not empty and is not a model directory: choose another path")
    if not force:
        raise ModelDirectoryError(out, "a model directory is already there: pass --force to replace it")
    shutil.rmtree(out)


def write_model_dir(
    out: str | Path,
    spec: ModelSpec = ModelSpec(),
    dtype: torch.dtype = torch.float32,
    init_device: str = "cpu",
    tokenizer=None,
) -> Path:
    """Write the directory. Weights are deterministic per (seed, init_device); a GPU draws 2B numbers fast.
    `tokenizer`: genrec's own by default; another (e.g. an open checkpoint's SID naming) has its layout inferred,
    and the random catalog takes level l's codes by position among that level's tokens."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer(spec.levels, spec.codebook, seed=spec.seed)
    vocab = spec.vocab_size or len(tokenizer)
    if vocab < len(tokenizer):
        raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    config = decoder_config(spec, vocab, spec.architecture, spec.tie_word_embeddings)
    body = config.to_hf_dict()
    body.update(
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    (out / "config.json").write_text(json.dumps(body, indent=2))
    tokenizer.save_pretrained(str(out))
    generator = torch.Generator(init_device).manual_seed(spec.seed)
    write_atomically(out / "model.safetensors", save(random_weights(config, generator, dtype)))
    generator = torch.Generator().manual_seed(spec.seed + 1)

    layout = SidLayout.infer(tokenizer)
    indices = _random_codes(spec.items, spec.levels, spec.codebook, spec.seed)
    levels = layout.level_ids[: spec.levels]  # a level smaller than the codebook (another tokenizer's) wraps
    codes = np.stack([ids[indices[:, level] % len(ids)] for level, ids in enumerate(levels)], axis=1)
    item_ids = np.array([f"item-{i:06d}" for i in range(spec.items)], dtype=object)
    Catalog.validated(item_ids, codes, layout).save(out / GENREC_SUBDIR / "catalog.parquet")
    if spec.user_dim:
        projector = SoftTokenProjector(spec.user_dim, spec.hidden)
        with torch.no_grad():
            projector.weight.normal_(0.0, 1.0 / math.sqrt(spec.user_dim), generator=generator)
            projector.bias.normal_(0.0, 0.1, generator=generator)
        projector.save(out / GENREC_SUBDIR / "soft_token.safetensors")
    return out


def decoder_config(shape, vocab_size: int, architecture: str, tie_word_embeddings: bool) -> Qwen3Config:
    """The decoder's config from a spec's shape fields (hidden, layers, heads, ...): ModelSpec's or an open layout's."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=tie_word_embeddings,
        architecture=architecture,
    )


def random_weights(c: Qwen3Config, g: torch.Generator, dtype) -> dict[str, torch.Tensor]:
    def normal(*shape, std):
        return (torch.randn(*shape, generator=g, device=g.device) * std).to(dtype).cpu()

    def linear(out_features, in_features, gain=1.0):
        return normal(out_features, in_features, std=gain / math.sqrt(in_features))

    def norm(dim):
        return (1.0 + torch.randn(dim, generator=g, device=g.device) * 0.1).to(dtype).cpu()

    q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    w = {"model.embed_tokens.weight": normal(c.vocab_size, c.hidden_size, std=1.0)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = linear(q_out, c.hidden_size)
        w[p + "self_attn.k_proj.weight"] = linear(kv_out, c.hidden_size)
        w[p + "self_attn.v_proj.weight"] = linear(kv_out, c.hidden_size)
        w[p + "self_attn.o_proj.weight"] = linear(c.hidden_size, q_out)
        if c.arch.qk_norm:
            w[p + "self_attn.q_norm.weight"] = norm(c.head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(c.head_dim)
        if c.qkv_bias:  # half the projections' output scale (std ~1): a bias left out would change the logits
            for name, size in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
                w[p + f"self_attn.{name}.bias"] = normal(size, std=0.5)
        if c.attention_bias:
            w[p + "self_attn.o_proj.bias"] = normal(c.hidden_size, std=0.1)
        w[p + "mlp.gate_proj.weight"] = linear(c.intermediate_size, c.hidden_size)
        w[p + "mlp.up_proj.weight"] = linear(c.intermediate_size, c.hidden_size)
        w[p + "mlp.down_proj.weight"] = linear(c.hidden_size, c.intermediate_size)
        w[p + "input_layernorm.weight"] = norm(c.hidden_size)
        w[p + "post_attention_layernorm.weight"] = norm(c.hidden_size)
    w["model.norm.weight"] = norm(c.hidden_size)
    if not c.tie_word_embeddings:
        # Logit std ~3: peaked next-token distributions, as in a trained model.
        w["lm_head.weight"] = linear(c.vocab_size, c.hidden_size, gain=3.0)
    return w


def _random_codes(items: int, levels: int, codebook: int, seed: int) -> np.ndarray:
    """`items` distinct codes in [0, codebook)^levels."""
    space = codebook**levels
    rng = np.random.default_rng(seed)
    chosen = np.unique(rng.integers(0, space, size=items * 2))
    while len(chosen) < items:
        chosen = np.unique(np.concatenate([chosen, rng.integers(0, space, size=items)]))
    flat = rng.permutation(chosen)[:items]
    digits = [(flat // codebook ** (levels - 1 - lv)) % codebook for lv in range(levels)]
    return np.stack(digits, axis=1).astype(np.int64)


# -- HSTU ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HSTUSpec:
    items: int = 500
    hidden: int = 64
    layers: int = 2
    heads: int = 2
    head_dim: int = 16
    max_positions: int = 4096
    normalizer: float | None = None  # None: max_positions (the longest sequence the model was sized for)
    actions: int = 4
    time_buckets: int = 16
    tasks: tuple[str, ...] = ("click", "like", "long_view")
    head_hidden: int = 64
    seed: int = 0

    def config(self) -> HSTUConfig:
        """The config this spec writes (raises ValueError for an impossible spec)."""
        return HSTUConfig(
            num_items=self.items,
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            head_dim=self.head_dim,
            attention_normalizer=float(self.normalizer or self.max_positions),
            max_positions=self.max_positions,
            num_actions=self.actions,
            tasks=tuple(self.tasks),
            head_hidden=self.head_hidden,
            num_time_buckets=self.time_buckets,
        )


HSTU_PRESETS = {
    # The CPU benchmark shape (DLRMv3-like, scaled down): model dim 256, 4 layers, 4 heads, head dim 64.
    "tiny": HSTUSpec(items=2000, hidden=256, layers=4, heads=4, head_dim=64, head_hidden=256),
}


def hstu_preset(name: str, **overrides) -> HSTUSpec:
    if name not in HSTU_PRESETS:
        raise ValueError(f"unknown HSTU preset {name!r}; choose one of {sorted(HSTU_PRESETS)}")
    return replace(HSTU_PRESETS[name], **overrides)


def random_hstu(config: HSTUConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> HSTU:
    """An HSTU with deterministic random weights (every parameter drawn, LayerNorms included, so a test that
    reads the parameters by name cannot pass on default ones)."""
    generator = torch.Generator().manual_seed(seed)

    def normal(p: torch.Tensor, std: float, mean: float = 0.0) -> None:
        p.copy_(mean + std * torch.randn(p.shape, generator=generator))

    model = HSTU(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            kind = name.rsplit(".", 1)[-1]
            if name.startswith("item_embedding"):
                normal(p, 1.0)
            elif "embedding" in name:
                normal(p, 0.5)
            elif "norm" in name:  # LayerNorm scale near 1, shift near 0
                normal(p, 0.1, mean=1.0 if kind == "weight" else 0.0)
            elif kind == "bias":
                normal(p, 0.1)
            else:  # a Linear: unit gain; the head's logits a little wider (std ~2)
                normal(p, (2.0 if name == "head.out.weight" else 1.0) / math.sqrt(p.shape[1]))
    return model.to(dtype).eval().requires_grad_(False)


def write_catalog(path: Path, item_ids: list[str], indices: list[int]) -> None:
    table = pa.table({"item_id": pa.array(item_ids, pa.string()), "item_index": pa.array(indices, pa.int64())})
    write_atomically(path, parquet_bytes(table))


def write_hstu_dir(out: str | Path, spec: HSTUSpec = HSTUSpec(), dtype: torch.dtype = torch.float32) -> Path:
    """Write the directory (created if needed; existing files are overwritten). Deterministic per spec."""
    out = Path(out)
    random_hstu(spec.config(), spec.seed).save(out, dtype=dtype)
    item_ids = [f"item-{i:06d}" for i in range(spec.items)]
    write_catalog(out / GENREC_SUBDIR / "catalog.parquet", item_ids, list(range(spec.items)))
    return out


def build_tokenizer(levels: int, codebook: int, seed: int = 0, base_vocab: int = 600) -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer (deterministic) plus genrec's special and semantic-ID tokens."""
    tok = trained_bpe([EOS_TOKEN], base_vocab, _WORDS, seed)
    tok.add_special_tokens({"additional_special_tokens": [USER_TOKEN]})
    tok.add_tokens(list(LABEL_TOKENS))
    tok.add_tokens([semantic_token(level, i) for level in range(levels) for i in range(codebook)])
    return tok


def trained_bpe(specials: list[str], vocab_size: int, words: list[str], seed: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on 400 seeded sentences of `words`; `specials` first (the first is EOS and pad)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=alphabet, special_tokens=list(specials), show_progress=False
    )
    rng = np.random.default_rng(seed)
    bpe.train_from_iterator((" ".join(rng.choice(words, size=int(rng.integers(4, 16)))) for _ in range(400)), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=specials[0], pad_token=specials[0])


_WORDS = (
    "user listened to podcast episode show music artist album track liked skipped saved played followed "
    "recommend next item history recent genre news comedy sports science story daily weekly morning "
    "evening the a and of in on for with is was yes no"
).split()
