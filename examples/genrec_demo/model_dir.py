"""Write the trained demo model as a standard model directory, plus what the demo needs beside the catalog.

config.json, model.safetensors, tokenizer files   transformers' own writers (loadable by transformers, vLLM)
genrec/catalog.parquet                            item_id -> semantic ID, with genres, year, decade (attributes)
genrec/codebooks.safetensors                      build-ids' codebooks: new items coded by `genrec catalog add`
genrec/soft_token.safetensors                     the trained soft-token projector
genrec/items.parquet                              item_id, title (what the demo prints)
genrec/demo.json                                  the recipe (DemoConfig), the training figures and the ranking
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from transformers.utils import logging as hf_logging

from genrec.catalog import Catalog
from genrec.model.directory import GENREC_SUBDIR
from genrec_demo.catalog import write_catalog
from genrec_demo.config import DemoConfig
from genrec_demo.train import Trained

RECIPE = "demo.json"
ITEMS = "items.parquet"


def write_model(out: Path, model, projector, tokenizer, catalog: Catalog) -> None:
    """A model directory genrec serves: transformers' own files, then the catalog and the projector."""
    out.mkdir(parents=True, exist_ok=True)
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar per save is noise inside the training bar
    try:
        model.save_pretrained(str(out))
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(str(out))
    catalog.save(out / GENREC_SUBDIR / "catalog.parquet")
    projector.save(out / GENREC_SUBDIR / "soft_token.safetensors")


def write_demo_model(out: Path, trained: Trained, tokenizer, catalog: Catalog, codebooks, data, cfg: DemoConfig):
    write_model(out, trained.model, trained.projector, tokenizer, catalog)
    ours = out / GENREC_SUBDIR
    write_catalog(ours / "catalog.parquet", catalog, codebooks, data)  # the movies' attributes, the codebooks
    items = pa.table({"item_id": pa.array(catalog.item_ids.tolist(), pa.string()), "title": data.titles})
    pq.write_table(items, ours / ITEMS)
    # Written last: its presence marks a complete directory.
    (ours / RECIPE).write_text(json.dumps({"config": cfg.to_dict(), "training": trained.stats}, indent=2))


def write_recipe(model_dir: Path, recipe: dict) -> None:
    """Replaces demo.json whole (a rename), so a reader never sees half of it."""
    path = model_dir / GENREC_SUBDIR / RECIPE
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(recipe, indent=2))
    partial.replace(path)


def read_recipe(model_dir: Path) -> dict | None:
    path = model_dir / GENREC_SUBDIR / RECIPE
    return json.loads(path.read_text()) if path.is_file() else None


def read_titles(model_dir: Path) -> dict[str, str]:
    table = pq.read_table(model_dir / GENREC_SUBDIR / ITEMS)
    return dict(zip(table.column("item_id").to_pylist(), table.column("title").to_pylist(), strict=True))
