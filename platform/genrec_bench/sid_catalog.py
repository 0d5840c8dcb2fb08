"""`genrec bench sid-catalog`: what a large SID catalog costs. The trie of 1 M items over 3 levels of 8,192 codes
(OpenOneRec's shape) is built and timed on the host (the engine builds it once at load); then beam search over it
against the same model and prompts over a catalog of 256 codes per level, round-robin. The catalogs are random
codes drawn per level, each level's codes the model's own tokens (its SID layout)."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from genrec.api import RetrieveRequest
from genrec.catalog import Catalog, CodeTrie
from genrec.engine import Engine, SchedulerConfig
from genrec.engine.plan import ExecutionPlan
from genrec.engine.retriever import Retriever
from genrec.model.directory import ModelDir
from genrec.testing.tiny import preset
from genrec_bench.cli import SidCatalogOptions
from genrec_bench.common import cached_dir, interleaved_medians, machine, random_prompt, write_decoder

COLD = SchedulerConfig(prefix_cache_bytes=0)  # every round repeats the prompts: no prefix reuse
GOALS = {"trie_build_s": 30.0, "retrieve_large_over_small": 1.05}


def run(o: SidCatalogOptions) -> dict:
    directory, tokenizer, layout = sid_model(o)
    rng = np.random.default_rng(0)
    large, validate_s = random_catalog(layout, o.items, o.per_level, rng)
    small, _ = random_catalog(layout, o.items, o.small_per_level, rng)
    build_s = statistics.median(_build_seconds(large, layout) for _ in range(o.build_repeats))
    dtype = torch.bfloat16 if o.device.startswith("cuda") else torch.float32
    model = directory.load_model(o.device, dtype)
    plan = ExecutionPlan.build(o.device, dtype, o.cuda_fast)
    engines = {
        name: Engine(Retriever(model, tokenizer, catalog, None, layout, ops=plan.ops), COLD, plan=plan)
        for name, catalog in (("large", large), ("small", small))
    }
    generator = torch.Generator().manual_seed(0)
    requests = [
        RetrieveRequest(
            prompt_token_ids=random_prompt(engines["small"], o.prompt_len, generator), beam_width=o.beam_width
        )
        for _ in range(o.batch)
    ]
    seconds = interleaved_medians(
        {f"retrieve_{name}": (lambda e=engine: e.retrieve(requests)) for name, engine in engines.items()},
        o.repeats,
        o.device,
    )
    ratio = seconds["retrieve_large"] / seconds["retrieve_small"]
    return {
        "benchmark": "sid-catalog",
        "model": str(directory.path),
        "preset": o.preset,
        "device": o.device,
        "dtype": str(dtype),
        "items": o.items,
        "levels": o.levels,
        "per_level": {"large": o.per_level, "small": o.small_per_level},
        "codes": {"large": engines["large"].family.trie.codes, "small": engines["small"].family.trie.codes},
        "beam_width": o.beam_width,
        "prompt_len": o.prompt_len,
        "batch": o.batch,
        "repeats": o.repeats,
        "catalog_validate_s": validate_s,
        "trie_build_s": build_s,
        "seconds": seconds,
        "ratios": {"retrieve_large_over_small": ratio},
        "goals": GOALS,
        "meets_goals": build_s <= GOALS["trie_build_s"] and ratio <= GOALS["retrieve_large_over_small"],
        "machine": machine(),
    }


def sid_model(o) -> tuple[ModelDir, object, object]:
    """The cached model of `sid_model_dir`, its tokenizer and its SID layout."""
    directory = ModelDir.open(sid_model_dir(o), family="qwen3")
    tokenizer = directory.load_tokenizer()
    return directory, tokenizer, directory.load_sid_layout(tokenizer)


def sid_model_dir(o: SidCatalogOptions):
    """A cached random-weight model of the preset's dimensions whose vocabulary holds `per_level` codes per level."""
    spec = preset(o.preset, levels=o.levels, codebook=o.per_level, items=1000, user_dim=0)
    return cached_dir(f"sid-{o.preset}", spec, write_decoder)


def random_catalog(layout, items: int, per_level: int, rng) -> tuple[Catalog, float]:
    """A random catalog drawing each level's code among the level's first `per_level` tokens, validated against
    the layout (timed, as the model directory's loader does it)."""
    levels = [ids[:per_level] for ids in layout.level_ids]
    codes = np.stack([ids[rng.integers(0, len(ids), size=items)] for ids in levels], axis=1)
    item_ids = np.array([f"i{k}" for k in range(items)], dtype=object)
    start = time.perf_counter()
    catalog = Catalog.validated(item_ids, codes, layout)
    return catalog, time.perf_counter() - start


def _build_seconds(catalog: Catalog, layout) -> float:
    start = time.perf_counter()
    CodeTrie.build(catalog.codes, "cpu", catalog.lengths, layout.ending, catalog.popularity)
    return time.perf_counter() - start
