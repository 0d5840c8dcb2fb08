"""What the scripts in `jobs/` share: the embedding-cache flags and one clear line for bad input."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from pydantic import ValidationError

from genrec.cache.settings import CacheSettings
from genrec.errors import GenrecError


def add_cache_flags(parser: argparse.ArgumentParser, required: bool = False) -> None:
    group = parser.add_argument_group("embedding cache (the named EmbeddingCache actor; created on first use)")
    group.add_argument("--cache", required=required, metavar="NAME", help="cache name")
    group.add_argument("--cache-shards", type=int, default=1)
    group.add_argument("--cache-capacity", type=int, default=1_000_000, help="vectors resident per shard")
    group.add_argument("--cache-store", choices=["sqlite", "redis", "none"], default="sqlite")
    group.add_argument("--cache-store-path", default="/tmp/genrec-embeddings.sqlite", help="sqlite file")
    group.add_argument("--cache-redis-url", default="redis://127.0.0.1:6379/0")


def cache_spec(args: argparse.Namespace) -> CacheSettings | None:
    if not args.cache:
        return None
    return CacheSettings(
        name=args.cache,
        shards=args.cache_shards,
        capacity=args.cache_capacity,
        store=args.cache_store,
        store_path=args.cache_store_path,
        redis_url=args.cache_redis_url,
    )


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
        flag = "--" + str(problem["loc"][0]).replace("_", "-") if problem["loc"] else None
        parts.append(f"{flag}: {message}" if flag else message)
    return "; ".join(parts)
