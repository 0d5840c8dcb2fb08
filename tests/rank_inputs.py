"""Inputs of the batch rank job's tests: a small HSTU model directory and users Parquet rows (history, candidates)."""

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from genrec.testing.tiny import HSTUSpec, write_hstu_dir

SPEC = HSTUSpec(items=60, hidden=16, layers=1, heads=2, head_dim=8, max_positions=32, actions=3, time_buckets=4)
EVENT = pa.struct([("item_id", pa.string()), ("action", pa.int32()), ("timestamp", pa.float64())])


def schema(user_id: pa.DataType = pa.string()) -> pa.Schema:
    return pa.schema(
        [
            ("user_id", user_id),
            ("history", pa.list_(EVENT)),
            ("candidates", pa.list_(pa.string())),
            ("tasks", pa.list_(pa.string())),
        ]
    )


def item(rng: random.Random) -> str:
    return f"item-{rng.randrange(SPEC.items):06d}"


def user_row(rng: random.Random, user_id, events: int, candidates: int) -> dict:
    t, history = 1.7e9, []
    for _ in range(events):
        t += rng.choice([5.0, 300.0, 86400.0])
        history.append({"item_id": item(rng), "action": rng.choice([None, 0, 1, 2]), "timestamp": t})
    return {"user_id": user_id, "history": history, "candidates": [item(rng) for _ in range(candidates)]}


def users_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [user_row(rng, f"user-{i:03d}", events=1 + i % 9, candidates=1 + i % 5) for i in range(n)]


def write_users(path, rows: list[dict], user_id: pa.DataType = pa.string()) -> None:
    pq.write_table(pa.Table.from_pylist(rows, schema(user_id)), path)


def model_dir(parent) -> Path:
    return write_hstu_dir(Path(parent) / "hstu", SPEC)
