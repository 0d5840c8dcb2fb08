"""Nightly batch recommendation: users Parquet -> one row per (user, rank) in OUT/recommendations/.

    python jobs/batch_recommend.py --model DIR --users USERS.parquet --out OUT_DIR [--rank] [--actors N]
    ray job submit --working-dir . -- python jobs/batch_recommend.py --model ... (absolute paths)

--rank recommends (retrieve, then rank); --rank-by joint [--score-weight W] ranks by the generator's and the
label's log-probabilities together (RecommendRequest.rank_by).

--ranker HSTU_DIR adds a second Ray Data stage (its own --rank-actors, --rank-cpus-per-actor): each user's items
are ranked after the user's `history` column (as jobs/batch_rank.py reads it) and ordered by --rank-task's
probability; the rows gain retrieval_rank (stage 1's order) and one prob_<task> column per ranker task. Items
the ranker does not know keep stage 1's order after the ranked ones; a user whose history the ranker refuses
is an error row.
Rerun with the same arguments after a failure: committed shards are skipped, the rest are computed.
Exit status: 0, or 1 when the fraction of bad rows (repeated user_ids among them) passes --max-error-fraction,
or 2 for bad arguments (an --out that cannot be written, --num-gpus that the cluster cannot give among them).
"""

import argparse

import _need_genrec  # noqa: F401  (first: one clear line when this python lacks genrec)

from genrec.batch import BatchSpec, FunnelSpec, run_batch, run_funnel
from genrec.batch.job_args import (
    add_cache_flags,
    add_ranker_flags,
    add_shard_job_flags,
    cache_config,
    execution,
    finish,
    job_spec_fields,
    ranking_execution,
    run_job,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shard_job_flags(parser, users_help="Parquet file or directory: user_id, prompt | prompt_token_ids")
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
    add_cache_flags(parser)
    add_ranker_flags(parser)
    args = parser.parse_args()

    ranking = ranking_execution(args)
    settings = dict(
        beam_width=args.beam_width,
        num_results=args.num_results,
        rank=args.rank,
        rank_by=args.rank_by,
        score_weight=args.score_weight,
        cache=cache_config(args),
        **job_spec_fields(args),
    )
    run = execution(args)
    if args.ranker is None:
        return finish(run_batch(BatchSpec(**settings), run), run)
    spec = FunnelSpec(ranker=args.ranker, rank_task=args.rank_task, **settings)
    return finish(run_funnel(spec, run, ranking), run)


if __name__ == "__main__":
    run_job(main)
