"""Semantic IDs from item embeddings for a large catalog: Ray Data reads the Parquet in parallel, then
`genrec build-ids`' algorithm writes the model's catalog.

    python jobs/build_semantic_ids.py --embeddings ITEMS.parquet --model DIR [--out CATALOG.parquet]
    ray job submit --working-dir . -- python jobs/build_semantic_ids.py --embeddings /abs/ITEMS --model /abs/DIR
"""

import argparse
import json

import _need_genrec  # noqa: F401  (first: one clear line when this python lacks genrec)

from genrec.batch.job_args import run_job
from genrec.batch.semantic_ids import build_semantic_ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--embeddings", required=True, help="Parquet file, directory or URI: item_id, embedding")
    parser.add_argument("--model", required=True, help="model directory whose tokenizer defines the ID tokens")
    parser.add_argument("--out", default=None, help="catalog to write (default: MODEL/genrec/catalog.parquet)")
    parser.add_argument("--iters", type=int, default=20, help="k-means iterations per level")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print(json.dumps(build_semantic_ids(args.embeddings, args.model, args.out, args.iters, args.seed)), flush=True)
    return 0


if __name__ == "__main__":
    run_job(main)
