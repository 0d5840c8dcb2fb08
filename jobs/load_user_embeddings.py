"""Bulk-load a nightly `user_id, embedding` Parquet into the embedding cache's durable store; warms the actor.

    python jobs/load_user_embeddings.py --embeddings EMB.parquet --cache users [--cache-store redis ...]
    ray job submit --working-dir . -- python jobs/load_user_embeddings.py --embeddings /abs/EMB.parquet ...

Use the same --cache-* settings as the Serve config and jobs/batch_recommend.py, so all find the same cache.
"""

import argparse
import json

import _need_genrec  # noqa: F401  (first: one clear line when this python lacks genrec)

from genrec.batch import load_user_embeddings
from genrec.batch.job_args import add_cache_flags, cache_config, run_job


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--embeddings", required=True, help="Parquet with user_id, embedding (list<float>)")
    parser.add_argument("--dim", type=int, default=None, help="embedding size (default: read from the file)")
    parser.add_argument("--batch-rows", type=int, default=65536, help="rows per put")
    add_cache_flags(parser, required=True)
    args = parser.parse_args()

    print(json.dumps(load_user_embeddings(args.embeddings, cache_config(args), args.dim, args.batch_rows)), flush=True)
    return 0


if __name__ == "__main__":
    run_job(main)
