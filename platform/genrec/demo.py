"""The demo: build a tiny model locally, load it through the user-facing path, retrieve."""

from __future__ import annotations

from pathlib import Path

from genrec.api import RetrieveRequest
from genrec.engine import Engine
from genrec.model.tiny import ModelSpec, write_model_dir


def run_demo(model_dir: Path) -> dict:
    if not (model_dir / "config.json").exists():
        write_model_dir(model_dir, ModelSpec(items=1000, levels=3, codebook=16))
    engine = Engine.from_pretrained(model_dir)
    request = RetrieveRequest(
        prompt="user listened to comedy podcast episode then news daily", beam_width=32, num_results=5
    )
    (result,) = engine.retrieve([request])
    return {"model_dir": str(model_dir), "retrieve": result.model_dump()}
