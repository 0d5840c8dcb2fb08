"""MovieLens -> SVD factors -> semantic IDs (genrec's build-ids) -> a trained model directory."""

from __future__ import annotations

from pathlib import Path

from genrec.model.sid_layout import SidLayout
from genrec.model.tokenizer import LABEL_TOKENS, USER_TOKEN
from genrec.testing.tiny import build_tokenizer
from genrec_demo.batches import Vocab, near_items
from genrec_demo.catalog import build_catalog
from genrec_demo.config import DemoConfig
from genrec_demo.data import MovieLens
from genrec_demo.factors import Factors
from genrec_demo.model_dir import write_demo_model
from genrec_demo.train import train


def build_model(data: MovieLens, factors: Factors, out: Path, cfg: DemoConfig, progress: bool = True) -> dict:
    """Train on every user's training items; returns the training figures (also in genrec/demo.json)."""
    tokenizer = build_tokenizer(cfg.levels, cfg.codebook, seed=cfg.seed)
    catalog, codebooks = build_catalog(data, factors, SidLayout.infer(tokenizer), cfg.seed)
    yes, no = tokenizer.convert_tokens_to_ids(list(LABEL_TOKENS))
    vocab = Vocab(catalog.codes, tokenizer.convert_tokens_to_ids(USER_TOKEN), yes, no)
    histories = [data.train(u) for u in range(len(data.user_ids))]
    near = near_items(factors.users, factors.items, histories, cfg.near)
    trained = train(histories, factors.users, vocab, tokenizer, cfg, near, progress)
    write_demo_model(out, trained, tokenizer, catalog, codebooks, data, cfg)
    return trained.stats
