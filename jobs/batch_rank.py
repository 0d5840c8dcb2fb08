"""Nightly batch ranking: users Parquet (history, candidates) -> one row per (user, candidate) in OUT/rankings/.

    python jobs/batch_rank.py --model HSTU_DIR --users USERS.parquet --out OUT_DIR [--rank-by TASK] [--actors N]
    ray job submit --working-dir . -- python jobs/batch_rank.py --model ... (absolute paths)

Each user's candidates get every task's probability (columns prob_<task>); --rank-by TASK orders them by that
task's probability, highest first (ties in the candidates' order); without it, rank is the candidates' order.
Rerun with the same arguments after a failure: committed shards are skipped, the rest are computed.
Exit status: 0, or 1 when the fraction of bad rows (repeated user_ids among them) passes --max-error-fraction,
or 2 for bad arguments (an --out that cannot be written, --num-gpus that the cluster cannot give among them).
"""

import argparse

import _need_genrec  # noqa: F401  (first: one clear line when this python lacks genrec)

from genrec.batch import RankSpec, run_rank
from genrec.batch.job_args import add_shard_job_flags, execution, finish, job_spec_fields, run_job


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shard_job_flags(parser, users_help="Parquet file or directory: user_id, history, candidates, optionally tasks")
    parser.add_argument("--rank-by", metavar="TASK", help="a task of the model (default: keep the given order)")
    args = parser.parse_args()

    spec = RankSpec(rank_by=args.rank_by, **job_spec_fields(args))
    run = execution(args)
    return finish(run_rank(spec, run), run)


if __name__ == "__main__":
    run_job(main)
