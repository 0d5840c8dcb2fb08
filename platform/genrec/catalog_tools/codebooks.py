"""What build-ids keeps to code a new item later, `codebooks.safetensors` beside its catalog, never in the model's root
(docs/engine.md, 'New items without retraining: `genrec catalog add` / `retire`')."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from genrec.catalog.catalog import bytes_version
from genrec.errors import CatalogError
from genrec.files import write_atomically

CODEBOOKS_FILE = "codebooks.safetensors"
# A catalog build-ids wrote records the hash of the codebooks written with it (Parquet metadata, kept by add and
# retire), so codebooks that did not code it (another build's since, an interrupted run's) are told apart.
BUILT_WITH_KEY = b"genrec.codebooks"
NO_CODEBOOKS = (
    "missing: the catalog has no codebooks to code new items with. Only a catalog `genrec build-ids` wrote (since it "
    "keeps them) can take new items; one imported from another project (`genrec catalog import`, e.g. OpenOneRec's "
    "or MiniOneRec's) or built before cannot: rebuild it with `genrec build-ids`"
)


@dataclass(frozen=True)
class Codebooks:
    """`centers[l]`: level l's k-means centers [codes_l, dim] (row = code index) over the residual left by the
    levels above; `scale`: what the embeddings were divided by before level 0; `last_size`: codes of the last,
    disambiguating level."""

    scale: float
    centers: tuple[torch.Tensor, ...]
    last_size: int

    @property
    def dim(self) -> int:
        return self.centers[0].shape[1]

    @staticmethod
    def path_beside(catalog_path: Path) -> Path:
        return Path(catalog_path).parent / CODEBOOKS_FILE

    def to_bytes(self) -> bytes:
        """The safetensors file (its hash is the version `load` returns, which a built catalog records)."""
        tensors = {f"level_{level}": c.contiguous().float() for level, c in enumerate(self.centers)}
        tensors["scale"] = torch.tensor([self.scale], dtype=torch.float32)
        tensors["last_size"] = torch.tensor([self.last_size], dtype=torch.int64)
        return save(tensors)

    def save(self, path: Path) -> None:
        write_atomically(path, self.to_bytes())

    @classmethod
    def load(cls, path: Path) -> tuple[Codebooks, str]:
        """The codebooks in `path` and their version (the hash of the file's bytes)."""
        if not path.is_file():
            raise CatalogError(path, NO_CODEBOOKS)
        try:
            data = path.read_bytes()
            tensors = load(data)
        except (SafetensorError, OSError) as err:
            raise CatalogError(path, f"not readable as safetensors ({err})") from None
        levels = sum(name.startswith("level_") for name in tensors)
        missing = [n for n in ("scale", "last_size", *(f"level_{i}" for i in range(levels))) if n not in tensors]
        if missing or levels == 0:
            raise CatalogError(path, f"tensor {(missing or ['level_0'])[0]!r} is missing")
        centers = tuple(tensors[f"level_{i}"] for i in range(levels))
        if any(c.ndim != 2 or c.shape[1] != centers[0].shape[1] for c in centers):
            raise CatalogError(path, f"centers of different widths: {[tuple(c.shape) for c in centers]}")
        return cls(float(tensors["scale"][0]), centers, int(tensors["last_size"][0])), bytes_version(data)

    @staticmethod
    def check_built_with(version: str, catalog_metadata: dict | None, catalog: Path, path: Path) -> None:
        """The catalog was built with these codebooks (a catalog that records none, from before, is taken)."""
        recorded = (catalog_metadata or {}).get(BUILT_WITH_KEY)
        if recorded is not None and recorded.decode() != version:
            raise CatalogError(
                catalog,
                f"was built with other codebooks than {path} (its {recorded.decode()}, theirs {version}): build-ids "
                "wrote another catalog there since, or was interrupted; rebuild it with `genrec build-ids`",
            )

    def check_layout(self, layout, path: Path) -> None:
        """The codebooks were built for this model's SID layout: one level fewer than the layout (the last one
        disambiguates), no more centers than a level has codes."""
        sizes = layout.level_sizes
        fits = len(self.centers) == len(sizes) - 1 and self.last_size == sizes[-1]
        if not fits or any(len(c) > k for c, k in zip(self.centers, sizes, strict=False)):
            built = [len(c) for c in self.centers] + [self.last_size]
            raise CatalogError(path, f"built for levels of {built} codes; the model's SID layout has {sizes}")
