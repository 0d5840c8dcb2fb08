"""The model directory: a plain Hugging Face directory plus genrec's own files under `genrec/`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from genrec.errors import ModelDirectoryError
from genrec.model.config import Qwen3Config
from genrec.model.digests import RECORD, DigestRecord

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


def directory_family(path: str | Path) -> str:
    """Which model family a directory holds, from its config.json's model_type: "hstu" or "qwen3" (anything else
    is left to the Qwen3 loader to refuse with its own message)."""
    from genrec.model.hstu_config import HSTU_MODEL_TYPE

    try:
        model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return "qwen3"
    return "hstu" if model_type == HSTU_MODEL_TYPE else "qwen3"


def model_version(path: str | Path) -> str:
    """A content hash of every file in the model directory (names and bytes): the version Serve and the
    batch job report, so a response or an output row says exactly which weights and catalog produced it.
    The large files' digests come from `genrec/digests.json` while they are unchanged (see model.digests)."""
    root = Path(path)
    record = DigestRecord(root / GENREC_SUBDIR / RECORD)
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file() and not record.owns(p)):
        name = file.relative_to(root).as_posix()
        digest.update(name.encode() + b"\0")
        digest.update(record.digest(file, name))
    record.save()
    return digest.hexdigest()[:16]
