"""Nightly batch recommendation: users Parquet -> one row per (user, rank) in OUT/recommendations/.

    python jobs/batch_recommend.py --model DIR --users USERS.parquet --out OUT_DIR [--rank] [--actors N]
    ray job submit --working-dir . -- python jobs/batch_recommend.py --model ... (absolute paths)

--rank recommends (retrieve, then rank); --rank-by joint [--score-weight W] ranks by the generator's and the
label's log-probabilities together (RecommendRequest.rank_by).
Rerun with the same arguments after a failure: committed shards are skipped, the rest are computed.
Exit status: 0, or 1 when the fraction of bad rows passes --max-error-fraction, or 2 for bad arguments.
"""

import argparse

from genrec.batch import BatchSpec, Execution, run_batch
from genrec.batch.job_args import add_cache_flags, add_engine_flags, cache_config, engine_options, run_job


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--users", required=True, help="Parquet file or directory: user_id, prompt | prompt_token_ids")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--beam-width", type=int, default=30)
    parser.add_argument("--num-results", type=int, default=None, help="items per user (default: beam width)")
    parser.add_argument("--rank", action="store_true", help="recommend: score the retrieved items (and candidates)")
    parser.add_argument(
        "--rank-by",
        choices=("score", "joint"),
        default="score",
        help="with --rank: by the label score, or by "
        "log P(item) + weight * log P(label | item) (the demo model's; see RecommendRequest.rank_by)",
    )
    parser.add_argument("--score-weight", type=float, default=1.0, help="with --rank-by joint: the label's weight")
    parser.add_argument("--batch-size", type=int, default=64, help="users per engine call and per output file")
    parser.add_argument("--actors", type=int, default=1, help="engine actors (one model copy each)")
    parser.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per actor (0: CPU engine)")
    parser.add_argument("--cpus-per-actor", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per actor")
    parser.add_argument("--kv-budget-bytes", type=int, default=None, help="each actor's KV pool (default: by device)")
    parser.add_argument("--max-error-fraction", type=float, default=0.01)
    parser.add_argument("--no-progress", action="store_true", help="no Ray Data progress bars")
    add_engine_flags(parser)
    add_cache_flags(parser)
    args = parser.parse_args()

    spec = BatchSpec(
        model=args.model,
        users=args.users,
        out=args.out,
        beam_width=args.beam_width,
        num_results=args.num_results,
        rank=args.rank,
        rank_by=args.rank_by,
        score_weight=args.score_weight,
        batch_size=args.batch_size,
        device="cuda" if args.num_gpus > 0 else "cpu",
        cache=cache_config(args),
        **engine_options(args),
    )
    execution = Execution(
        actors=args.actors,
        num_gpus=args.num_gpus,
        cpus_per_actor=args.cpus_per_actor,
        threads=args.threads,
        kv_budget_bytes=args.kv_budget_bytes,
        max_error_fraction=args.max_error_fraction,
        progress=not args.no_progress,
    )
    summary = run_batch(spec, execution)
    print(summary.line(), flush=True)
    return 1 if summary.failed(execution.max_error_fraction) else 0


if __name__ == "__main__":
    run_job(main)
