"""The model directory: a plain Hugging Face directory plus genrec's own files under `genrec/`."""

from __future__ import annotations

from pathlib import Path

from genrec.errors import ModelDirectoryError

GENREC_SUBDIR = "genrec"


class ModelDirectory:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ModelDirectoryError(self.path, "model directory does not exist")
        for name in ("config.json",):
            if not (self.path / name).exists():
                raise ModelDirectoryError(self.path, f"{name} is missing")
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
