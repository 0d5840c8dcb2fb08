"""The model directory: a plain Hugging Face directory plus genrec's own files under `genrec/`."""

from __future__ import annotations

import hashlib
from pathlib import Path

from genrec.errors import ModelDirectoryError
from genrec.model.config import Qwen3Config

GENREC_SUBDIR = "genrec"


class ModelDirectory:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ModelDirectoryError(self.path, "model directory does not exist")
        for name in ("config.json",):
            if not (self.path / name).exists():
                raise ModelDirectoryError(self.path, f"{name} is missing")
        # Validated first: the tokenizer reads config.json too and would report a bad one as its own failure.
        self.config = Qwen3Config.from_file(self.path / "config.json")
        if not self.catalog_path.exists():
            raise ModelDirectoryError(self.path, f"{GENREC_SUBDIR}/catalog.parquet is missing (the item catalog)")

    @property
    def genrec_dir(self) -> Path:
        return self.path / GENREC_SUBDIR

    @property
    def catalog_path(self) -> Path:
        return self.genrec_dir / "catalog.parquet"

    @property
    def soft_token_path(self) -> Path:
        return self.genrec_dir / "soft_token.safetensors"


def model_version(path: str | Path) -> str:
    """A content hash of every file in the model directory (names and bytes): the version Serve and the
    batch job report, so a response or an output row says exactly which weights and catalog produced it."""
    root = Path(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(file.relative_to(root).as_posix().encode() + b"\0")
        with file.open("rb") as handle:
            digest.update(hashlib.file_digest(handle, "sha256").digest())
    return digest.hexdigest()[:16]
