"""The one reader of a model directory: `ModelDir.open(path)`; nothing else in genrec opens a model's files
(docs/engine.md, 'Model directory'). `open` returns the family's object (Qwen3Dir, HSTUDir): config, version,
catalog, a loader per part, and `check`, which checks all a replica reads without reading the weights (shapes and
dtypes from the headers). Loaders import their heavy parts (transformers, the forward code, safetensors) when called,
so `check`, run by light processes such as the deploy's preflight, never pays for them.

The version is a content hash of the files the family's loaders read (`version_files`), no other: a catalog, notes
or a cache beside them leave it. Its large-file digests are kept in `genrec/digests.json` (`DigestRecord`), trusted
while a file keeps its size and mtime (as make and git's index do): headers and sizes would not do, two fine-tunes
share every shape. Recording is best effort: a read-only directory is hashed at every start unless recorded before.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from functools import cached_property
from pathlib import Path
from typing import ClassVar

import torch

from genrec.catalog.catalog import Catalog, ItemIndex
from genrec.errors import ModelDirectoryError
from genrec.files import write_atomically
from genrec.model.config import CONFIG_FILE, FAMILY_NAMES, HSTUConfig, Qwen3Config, family_of, read_config
from genrec.model.sid_layout import LAYOUT_FILE, SidLayout
from genrec.model.tokenizer import PROMPT_FILE, ChatOptions, ChatTemplate, check_token_ids, load_tokenizer
from genrec.model.weights import Layout, load_state_dict, read_headers, weight_files

GENREC_SUBDIR = "genrec"
SINGLE_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded checkpoint's: it names the shards
# What transformers' AutoTokenizer may read of a directory (transformers.tokenization_utils_base): the files every
# tokenizer reads, then the vocabulary files of the tokenizer classes a Qwen-like checkpoint names (BPE,
# SentencePiece, WordPiece); its extra chat templates are CHAT_TEMPLATE_DIR/*.jinja. config.json is read too.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "vocab.txt",
)  # fmt: skip
CHAT_TEMPLATE_DIR = "additional_chat_templates"


class ModelDir:
    family: ClassVar[str]  # "qwen3" | "hstu"

    def __init__(self, path: Path, raw_config: dict):
        self.path = path
        self.config = self._config(raw_config)

    @staticmethod
    def open(path: str | Path, family: str | None = None) -> Qwen3Dir | HSTUDir:
        """The directory's family object, its config.json validated (and its family `family`, when given); raises
        ModelDirectoryError naming the file."""
        path = Path(path)
        if not path.is_dir():
            raise ModelDirectoryError(path, "model directory does not exist")
        raw = read_config(path / CONFIG_FILE)
        kind = HSTUDir if family_of(raw) == "hstu" else Qwen3Dir
        if family is not None and kind.family != family:
            raise ModelDirectoryError(path, f"{FAMILY_NAMES[kind.family]}, not {FAMILY_NAMES[family]}")
        return kind(path, raw)

    def _config(self, raw):
        raise NotImplementedError

    @property
    def catalog_path(self) -> Path:
        return self.catalog_path_of(self.path)

    @staticmethod
    def catalog_path_of(path: str | Path) -> Path:
        """Where a model directory keeps its catalog (either family)."""
        return Path(path) / GENREC_SUBDIR / "catalog.parquet"

    @cached_property
    def version(self) -> str:
        """A content hash of `version_files` (their names and bytes): the model's identity. It salts the prefix
        cache and names the model in answers (X-Model-Version) and batch runs (docs/engine.md, 'Model directory')."""
        return files_version(self.path, self.version_files())

    def version_files(self) -> list[Path]:
        """The files the version covers: each file the family's loaders read, where present. One list for both, so
        they cannot drift (tests/test_model_version.py fails a loader that opens a file missing here)."""
        return sorted({file for file in self._files_read() if file.is_file()})

    def _files_read(self) -> list[Path]:
        """Every file the family's loaders may read, but a catalog that changes under a running model."""
        return [self.path / CONFIG_FILE, *self._weight_sources()]

    def _weight_sources(self) -> list[Path]:
        """The weight files `load_weights` reads, and the index that names them (a sharded checkpoint)."""
        files = self.weight_files()
        return files if files == [self.path / SINGLE_WEIGHTS] else [self.path / WEIGHTS_INDEX, *files]

    @property
    def user_dim(self) -> int | None:
        """The width of the user vectors the model takes as a soft token; None: it takes none."""
        return None

    def weight_files(self) -> list[Path]:
        return weight_files(self.path)

    def load_weights(self) -> dict[str, torch.Tensor]:
        return load_state_dict(self.path)

    def check(self) -> None:
        """Every file a replica reads at start, checked without reading the weights (the deploy's and the batch
        driver's preflight); a ModelDirectoryError names the first bad one."""
        self.load_catalog()
        self.check_weights()

    def check_weights(self) -> None:
        """Each weight file's safetensors header (it must cover the file exactly) against the config: every tensor
        the config implies present, floating point and of the implied shape (`layout`; no tensor data read)."""
        self.layout().match(read_headers(self.weight_files()), self.path)

    def layout(self) -> Layout:
        """The checkpoint tensors the config implies (the family's model built on the meta device)."""
        raise NotImplementedError

    def load_catalog(self):
        raise NotImplementedError

    def load_model(self, device="cpu", dtype: torch.dtype = torch.float32):
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"

    def __eq__(self, other) -> bool:  # two readers of one directory (e.g. one checked on another node)
        return type(other) is type(self) and other.path == self.path

    def __hash__(self) -> int:
        return hash((type(self), self.path))


class Qwen3Dir(ModelDir):
    """A semantic-ID decoder: tokenizer, catalog of item codes, optionally a soft-token projector. The family is
    `qwen3` whatever `config.architecture` (qwen3 or qwen2) says: the architecture is the model's business alone."""

    family = "qwen3"

    def _config(self, raw) -> Qwen3Config:
        return Qwen3Config.from_dict(raw, self.path / CONFIG_FILE)

    def _files_read(self) -> list[Path]:
        """Also the tokenizer's files, the SID layout, the chat options and the soft-token projector; the catalog
        is versioned apart (`catalog_version`): a new one leaves the model, and its cached prefixes, valid."""
        tokenizer = [self.path / name for name in TOKENIZER_FILES]
        templates = (self.path / CHAT_TEMPLATE_DIR).glob("*.jinja")
        own = [self.sid_layout_path, self.prompt_path, self.soft_token_path]
        return [*super()._files_read(), *tokenizer, *templates, *own]

    @property
    def soft_token_path(self) -> Path:
        return self.path / GENREC_SUBDIR / "soft_token.safetensors"

    @cached_property
    def user_dim(self) -> int | None:
        """The projector's input width, from its header (no tensor read)."""
        if not self.soft_token_path.exists():
            return None
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.soft_token_path), "pt") as tensors:
                shape = tensors.get_slice("weight").get_shape()
        except (SafetensorError, OSError) as err:
            raise ModelDirectoryError(self.soft_token_path, f"cannot read soft-token projector ({err})") from None
        if len(shape) != 2:
            raise ModelDirectoryError(self.soft_token_path, f"soft-token weight has shape {shape}, not [hidden, user]")
        return shape[1]

    def load_tokenizer(self):
        """The tokenizer, checked to produce only token IDs the model's embedding has."""
        tokenizer = load_tokenizer(self.path)
        check_token_ids(tokenizer, self.config.vocab_size, self.path)
        return tokenizer

    @property
    def sid_layout_path(self) -> Path:
        return self.path / GENREC_SUBDIR / LAYOUT_FILE  # what SidLayout.for_model reads

    def load_sid_layout(self, tokenizer=None):
        """The SID layout: `genrec/sid_layout.json`, else inferred from the tokenizer (genrec.model.sid_layout)."""
        tokenizer = tokenizer if tokenizer is not None else self.load_tokenizer()
        return SidLayout.for_model(self.path, tokenizer)

    def load_catalog(self, tokenizer=None, layout=None):
        """The item catalog, every code checked against the model's SID layout."""
        layout = layout if layout is not None else self.load_sid_layout(tokenizer)
        return Catalog.load(self.catalog_path, layout)

    @property
    def prompt_path(self) -> Path:
        return self.path / GENREC_SUBDIR / PROMPT_FILE

    def load_chat(self, tokenizer=None):
        """How `messages` prompts are rendered: the tokenizer's chat template with the options in
        `genrec/prompt.json` (genrec.model.tokenizer)."""
        tokenizer = tokenizer if tokenizer is not None else self.load_tokenizer()
        # A history is written in codes: their tokens and wrappers may be in a message (not EOS, an ending's too).
        code_ids = set(self.load_sid_layout(tokenizer).token_id_list()) - {tokenizer.eos_token_id}
        layout_tokens = frozenset(tokenizer.convert_ids_to_tokens(sorted(code_ids)))
        return ChatTemplate(tokenizer, ChatOptions.load(self.prompt_path), self.prompt_path, layout_tokens)

    def load_projector(self):
        """The soft-token projector, or None when the model has none."""
        from genrec.model.soft_token import SoftTokenProjector

        if not self.soft_token_path.exists():
            return None
        return SoftTokenProjector.load(self.soft_token_path, self.config.hidden_size)

    def layout(self) -> Layout:
        from genrec.model.qwen3 import checkpoint_layout, meta_qwen3

        return checkpoint_layout(meta_qwen3(self.config))

    def load_model(self, device="cpu", dtype: torch.dtype = torch.float32):
        from genrec.model.qwen3 import load_qwen3

        self.check_weights()  # a mismatch names its file, as the preflight does
        return load_qwen3(self.config, self.load_weights(), self.path, device, dtype)

    def check(self) -> None:
        super().check()  # the tokenizer and the catalog, then the weights
        self.load_projector()
        self.load_chat()


class HSTUDir(ModelDir):
    """An HSTU ranker: its catalog maps item IDs to rows of the model's item-embedding table."""

    family = "hstu"

    def _config(self, raw) -> HSTUConfig:
        return HSTUConfig.from_dict(raw, self.path / CONFIG_FILE)

    def _files_read(self) -> list[Path]:
        """Also the catalog, the item -> row index: the embedding table's rows were trained against it."""
        return [*super()._files_read(), self.catalog_path]

    def load_catalog(self):
        return ItemIndex.load(self.catalog_path, self.config.num_items)

    def layout(self) -> Layout:
        from genrec.model.hstu import checkpoint_layout, meta_hstu

        return checkpoint_layout(meta_hstu(self.config))

    def load_model(self, device="cpu", dtype: torch.dtype = torch.float32):
        from genrec.model.hstu import load_hstu

        self.check_weights()  # a mismatch names its file, as the preflight does
        return load_hstu(self.config, self.load_weights(), self.path, device, dtype)


def model_version(path: str | Path) -> str:
    """The version of the model in `path` (`ModelDir.version`)."""
    return ModelDir.open(path).version


def files_version(root: Path, files: list[Path]) -> str:
    """A content hash of `files` (each one's name under `root` and its bytes, in name order)."""
    record = DigestRecord(root / GENREC_SUBDIR / RECORD)
    digest = hashlib.sha256()
    for file in sorted(files):
        name = file.relative_to(root).as_posix()
        digest.update(name.encode() + b"\0")
        digest.update(record.digest(file, name))
    record.save()
    return digest.hexdigest()[:16]


RECORD = "digests.json"
LARGE_BYTES = 16 << 20  # below this a file is hashed at every call (config, tokenizer, projector, catalog)
# A file modified this shortly before it is read is not recorded: on a coarse clock, an edit in the same tick
# would keep its modification time.
SETTLE_NS = 2_000_000_000


def file_sha256(path: Path) -> bytes:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").digest()


class DigestRecord:
    """The recorded digests of one model directory's large files (relative POSIX path -> entry)."""

    def __init__(self, path: Path):
        self.path = path
        self.recorded = _read(path)
        self.seen: dict[str, dict] = {}

    def digest(self, file: Path, name: str) -> bytes:
        before = file.stat()
        if before.st_size < LARGE_BYTES:
            return file_sha256(file)
        key = {"size": before.st_size, "mtime_ns": before.st_mtime_ns}
        entry = self.recorded.get(name)
        if _fresh(entry, key):
            self.seen[name] = entry
            return bytes.fromhex(entry["sha256"])
        settled = time.time_ns() - before.st_mtime_ns > SETTLE_NS
        value = file_sha256(file)
        after = file.stat()
        if settled and (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns):
            self.seen[name] = {**key, "sha256": value.hex()}
        return value

    def save(self) -> None:
        """Write what this pass saw, if it differs from the record (atomically; a read-only directory is fine)."""
        if self.seen == self.recorded or not self.path.parent.is_dir():
            return
        with contextlib.suppress(OSError):
            write_atomically(self.path, json.dumps(self.seen, indent=1, sort_keys=True).encode())


def _fresh(entry, key: dict) -> bool:
    if not isinstance(entry, dict) or any(entry.get(k) != v for k, v in key.items()):
        return False
    value = entry.get("sha256")
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _read(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}
