"""What the scripts in `jobs/` share: the sharded jobs' common flags (model, input, output, execution), the
engine and embedding-cache flags, the summary line and exit status, and one clear line for bad input.

Flags left out are left out of the settings too, so their defaults are the settings' own (one place).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from pydantic import BaseModel, ValidationError

from genrec.batch.funnel_spec import RankingExecution
from genrec.batch.pipeline import Summary
from genrec.batch.spec import Execution, JobSpec
from genrec.cache.config import CacheConfig
from genrec.cache.policies import POLICIES
from genrec.engine_options import EngineOptions
from genrec.errors import GenrecError


def _default(model, field: str) -> str:
    return f"default: {model.model_fields[field].default}"


def add_shard_job_flags(parser: argparse.ArgumentParser, users_help: str) -> None:
    """The flags of every sharded job (recommend, rank): what it reads and writes, and how it executes."""
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--users", required=True, help=users_help)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--batch-size", type=int, default=64, help="users per engine call and per output file")
    parser.add_argument("--actors", type=int, default=1, help="engine actors (one model copy each)")
    parser.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per actor (0: CPU engine)")
    parser.add_argument(
        "--gpu-wait-s",
        type=float,
        help="when no node has the GPUs and the autoscaler publishes no GPU node type (ray up): ask it for one and "
        "wait this long (default: refuse at once)",
    )
    parser.add_argument("--cpus-per-actor", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per actor")
    parser.add_argument(
        "--pin-threads",
        action="store_true",
        default=None,
        help="bind each actor's threads to --threads cores of its node (Linux; needs --threads)",
    )
    parser.add_argument("--kv-budget-bytes", type=int, default=None, help="each actor's KV pool (default: by device)")
    parser.add_argument("--max-error-fraction", type=float, default=0.01)
    parser.add_argument("--no-progress", action="store_true", help="no Ray Data progress bars")
    add_engine_flags(parser)


def job_spec_fields(args: argparse.Namespace) -> dict:
    """The shared flags that are part of the run's identity (the engine flags among them), as JobSpec fields."""
    return {**_given(args, JobSpec.model_fields), "device": "cuda" if args.num_gpus > 0 else "cpu"}


def execution(args: argparse.Namespace) -> Execution:
    """How the run executes (the shared flags that a rerun may change)."""
    return Execution(**_given(args, Execution.model_fields), progress=not args.no_progress)


def finish(summary: Summary, run: Execution) -> int:
    """Print the summary line; the exit status: 1 when bad rows pass the allowed fraction, else 0."""
    print(summary.line(), flush=True)
    return 1 if summary.failed(run.max_error_fraction) else 0


def add_ranker_flags(parser: argparse.ArgumentParser) -> None:
    """The recommend job's funnel flags: with --ranker, a second stage ranks each user's items."""
    group = parser.add_argument_group("ranking stage (with --ranker: retrieve -> rank, two Ray Data stages)")
    group.add_argument("--ranker", metavar="HSTU_DIR", help="HSTU ranking model: ranks each user's items")
    group.add_argument("--rank-task", metavar="TASK", help="a task of the ranker: the final order (default: its first)")
    group.add_argument("--rank-actors", type=int, help=_default(RankingExecution, "rank_actors"))
    group.add_argument(
        "--rank-cpus-per-actor", type=float, help=f"fractional ({_default(RankingExecution, 'rank_cpus_per_actor')})"
    )


def ranking_execution(args: argparse.Namespace) -> RankingExecution:
    """The ranking stage's pool; its flags without --ranker are refused."""
    given = _given(args, RankingExecution.model_fields)
    if args.ranker is None and (given or args.rank_task is not None):
        flag = "--rank-task" if args.rank_task is not None else _flag((next(iter(given)),))
        raise GenrecError(f"{flag} applies to the ranking stage: give --ranker too")
    return RankingExecution(**given)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (part of the run's identity: a rerun must use the same)")
    group.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on CUDA, else float32"
    )
    group.add_argument("--max-candidates", type=int, help=_default(EngineOptions, "max_candidates"))
    group.add_argument("--score-max-tokens", type=int, help=_default(EngineOptions, "score_max_tokens"))
    group.add_argument("--max-candidate-tokens", type=int, help=_default(EngineOptions, "max_candidate_tokens"))
    group.add_argument("--cuda-fast", action="store_true", default=None, help="the unverified CUDA fast path")


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
        return " ".join(str(err).split())
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
