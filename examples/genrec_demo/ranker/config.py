"""The ranker's recipe: model shape, events window, negatives and training length. Saved with the model."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from genrec.model.config import HSTUConfig

ACTIONS = 5  # MovieLens ratings 1..5 -> actions 0..4


@dataclass(frozen=True)
class RankerConfig:
    window: int = 50  # history events the ranker sees (training rows and requests alike)
    hidden: int = 64
    layers: int = 2
    heads: int = 2
    head_dim: int = 16
    head_hidden: int = 64
    time_buckets: int = 20  # log2 gap buckets: 2^19 s (six days) and longer share the last one
    tasks: tuple[str, ...] = ("watch", "like")  # seed 0, validation: dropping "like" is within noise
    like_weight: float = 1.0  # weight of the "like" loss (rating >= 4 on the target)
    # Training: a fixed number of steps (bit-for-bit reproducible per seed); the learning rate anneals over them.
    # Tuned on seeds 10-14 with one retriever (docs/demo.md): 1,300 steps of 16 negatives (1.7 epochs) left the
    # ranker undertrained, its funnel NDCG@10 0.092-0.098 over a beam order of 0.091; 2,600 of 32 gave 0.104-0.108.
    steps: int = 2600  # about 200 CPU-seconds of one thread: it trains beside the retriever, which takes longer
    batch: int = 128
    negatives: int = 32  # per target; the target and its negatives are one softmax for "watch"
    negative_power: float = 1.0  # (interactions + 1) ** power
    near: int = 100  # each user's unseen items of highest SVD affinity ...
    near_weight: float = 0.5  # ... the share of negatives drawn from them (they resemble retrieval's beams)
    logq: bool = True  # subtract log q(item) from "watch" in training: it then learns log p(item | history)
    next_item_weight: float = 1.0  # auxiliary next-item loss on the history events (training only)
    dropout: float = 0.0  # on the input embeddings, training only
    embedding_std: float = 0.1  # the initial scale of every embedding (the item rows' first `rank` dims: SVD)
    svd_init: bool = True  # start the item embeddings from the SVD item factors (the retriever's item space)
    lr: float = 3e-3
    weight_decay: float = 0.01
    seed: int = 0

    def hstu_config(self, num_items: int) -> HSTUConfig:
        return HSTUConfig(
            num_items=num_items,
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            head_dim=self.head_dim,
            attention_normalizer=float(self.window),  # a constant: the longest history served
            max_positions=self.window + 1,  # history 0 .. window-1, the candidates at the history's length
            num_actions=ACTIONS,
            tasks=tuple(self.tasks),
            head_hidden=self.head_hidden,
            num_time_buckets=self.time_buckets,
        )

    def to_dict(self) -> dict:
        body = asdict(self)
        body["tasks"] = list(self.tasks)
        return body
