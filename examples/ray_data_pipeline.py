"""genrec as one stage of your own Ray Data pipeline: read users from anywhere Ray Data reads, recommend with
genrec.data, go on with your own transforms, write wherever you write (docs/batch.md, "genrec in your own pipeline").

    python examples/ray_data_pipeline.py --model out/demo-model --users out/demo/users.parquet --out /tmp/recs

Unlike jobs/batch_recommend.py, this pipeline is yours: no shards to resume, no run directory; bad rows come out as
rows with `error_field` / `error_reason` set, which this example writes to a folder of their own.
"""

from __future__ import annotations

import argparse
import os
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc


def recommendations(users, model: str, **settings):
    """`users` (a Dataset with user_id and a prompt) -> one row per (user, item), stamped with the time they were
    made: the genrec stage, then a map of your own."""
    import genrec.data

    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    recommended = genrec.data.Recommend(model, **settings)(users)
    return recommended.map_batches(lambda b: stamped(b, stamp), batch_format="pyarrow")


def stamped(batch: pa.Table, stamp: str) -> pa.Table:
    return batch.append_column("made_at", pa.array([stamp] * len(batch), pa.string()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a genrec Qwen3 semantic-ID model directory")
    parser.add_argument("--users", required=True, help="users Parquet (user_id and prompt or prompt_token_ids)")
    parser.add_argument("--out", required=True, help="output folder: recommendations/ and errors/")
    parser.add_argument("--beam-width", type=int, default=30)
    parser.add_argument("--num-results", type=int, default=10)
    parser.add_argument("--ranker", help="an HSTU ranker: the funnel (the users need a history column)")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local run; a cluster's own setting wins
    import ray

    settings = dict(beam_width=args.beam_width, num_results=args.num_results)
    if args.ranker:
        settings["ranker"] = args.ranker
    rows = recommendations(ray.data.read_parquet(args.users), args.model, **settings).materialize()
    for name, keep in (("recommendations", pc.is_null), ("errors", pc.is_valid)):
        part = rows.map_batches(lambda b, keep=keep: b.filter(keep(b["error_reason"])), batch_format="pyarrow")
        part.write_parquet(os.path.join(args.out, name))
    print(f"{rows.count()} rows in {args.out}")


if __name__ == "__main__":
    main()
