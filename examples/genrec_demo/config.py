"""The demo model's recipe: code shape, history length, model size, training budget. Saved with the model."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class DemoConfig:
    # Semantic IDs: `levels` tokens per item, `codebook` tokens per level, from an SVD of this rank.
    levels: int = 3
    codebook: int = 32
    rank: int = 32
    history: int = 50  # items in a prompt at most (training windows and requests alike)
    prompt_layout: str = "history-first"  # see genrec_demo.prompts (a model trained on another layout retrains)
    # The Qwen3: small enough that 5 CPU minutes are many epochs (quality here is bound by epochs).
    hidden: int = 64  # measured: 128 finished half the epochs and lost (0.155 vs 0.178 recall@10)
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 192
    max_positions: int = 1024
    # Training: a fixed number of steps, so the same command gives the same model on a loaded machine too (a
    # quiet 2-core box takes about 300 CPU-seconds of one thread for 2,000); the learning rate anneals over them.
    max_steps: int | None = 2000
    budget_cpu_s: float = 300.0  # only when max_steps is None: train for this many CPU-seconds instead
    batch: int = 32
    negatives: int = 8  # sampled per training window for the yes/no labels
    negative_power: float = 1.0  # negatives drawn by (interactions + 1) ** power: 0 uniform, 1 by popularity
    near: int = 100  # ... and from each user's `near` unseen items of highest SVD affinity (harder ones)
    near_weight: float = 0.5  # share of negatives drawn from those
    lr: float = 3e-3
    seed: int = 0
    users: int | None = None  # train and evaluate on the first N users only (tests); None: all 943

    def to_dict(self) -> dict:
        return asdict(self)
