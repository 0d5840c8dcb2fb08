"""What the scripts in `jobs/` share: the engine and embedding-cache flags, and one clear line for bad input.

Flags left out are left out of the settings too, so their defaults are the settings' own (one place).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from pydantic import BaseModel, ValidationError

from genrec.cache.config import CacheConfig
from genrec.cache.policies import POLICIES
from genrec.engine_options import EngineOptions
from genrec.errors import GenrecError


def _default(model, field: str) -> str:
    return f"default: {model.model_fields[field].default}"


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (part of the run's identity: a rerun must use the same)")
    group.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on CUDA, else float32"
    )
    group.add_argument("--max-candidates", type=int, help=_default(EngineOptions, "max_candidates"))
    group.add_argument("--score-max-tokens", type=int, help=_default(EngineOptions, "score_max_tokens"))
    group.add_argument("--cuda-fast", action="store_true", default=None, help="the unverified CUDA fast path")


def engine_options(args: argparse.Namespace) -> dict:
    """The engine flags given, as BatchSpec fields."""
    return _given(args, EngineOptions.model_fields)


def add_cache_flags(parser: argparse.ArgumentParser, required: bool = False) -> None:
    group = parser.add_argument_group("embedding cache (the named EmbeddingCache actor; created on first use)")
    group.add_argument("--cache", required=required, metavar="NAME", help="cache name")
    group.add_argument("--cache-shards", type=int, help=_default(CacheConfig, "shards"))
    group.add_argument(
        "--cache-capacity", type=int, help=f"vectors resident per shard ({_default(CacheConfig, 'capacity')})"
    )
    group.add_argument("--cache-policy", choices=sorted(POLICIES), help=_default(CacheConfig, "policy"))
    group.add_argument("--cache-admit-after", type=int, help=_default(CacheConfig, "admit_after"))
    group.add_argument("--cache-store", choices=["sqlite", "redis", "none"], help=_default(CacheConfig, "store"))
    group.add_argument("--cache-store-path", help=f"sqlite file ({_default(CacheConfig, 'store_path')})")
    group.add_argument("--cache-redis-url", help=_default(CacheConfig, "redis_url"))


class _CacheFlags(BaseModel):
    cache: CacheConfig  # validated as a field named `cache`: an error's location gives its flag (--cache-...)


def cache_config(args: argparse.Namespace) -> CacheConfig | None:
    if not args.cache:
        return None
    given = {k.removeprefix("cache_"): v for k, v in vars(args).items() if k.startswith("cache_") and v is not None}
    return _CacheFlags(cache={"name": args.cache, **given}).cache


def _given(args: argparse.Namespace, fields) -> dict:
    return {k: v for k, v in vars(args).items() if k in fields and v is not None}


def run_job(main: Callable[[], int]) -> None:
    """Exit with main's status; bad input (a missing file, invalid settings or data) exits 2 with one line."""
    try:
        status = main()
    except (GenrecError, ValueError, FileNotFoundError) as err:  # ValueError: pydantic's and load_parquet's
        print(f"error: {_one_line(err)}", file=sys.stderr)
        status = 2
    sys.exit(status)


def _one_line(err: Exception) -> str:
    if not isinstance(err, ValidationError):
        return str(err)
    parts = []
    for problem in err.errors():
        message = problem["msg"].removeprefix("Value error, ")
        flag = _flag(problem["loc"])
        parts.append(f"{flag}: {message}" if flag else message)
    return "; ".join(parts)


def _flag(loc: tuple) -> str | None:
    """The flag of a field: `beam_width` -> --beam-width, `cache.capacity` -> --cache-capacity."""
    names = [str(part) for part in loc if not isinstance(part, int)]
    if not names:
        return None
    flag = "--" + "-".join(names).replace("_", "-")
    return "--cache" if flag == "--cache-name" else flag
