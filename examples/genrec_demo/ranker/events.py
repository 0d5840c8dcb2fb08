"""Users' rated items as HSTU events, and padded training batches of them.

An event is (item row, action = rating - 1, gap bucket). A window's first event has the unknown bucket, as in a
request whose history starts there (the engine buckets each gap to the previous event *of the request*).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from genrec.model.config import HSTUConfig
from genrec_demo.data import MovieLens

# A batch job's `history` column: each row the request's events, oldest first (`MovieLens.events`).
HISTORY_TYPE = pa.list_(pa.struct([("item_id", pa.string()), ("action", pa.int64()), ("timestamp", pa.float64())]))


def history_array(histories: list[list[dict]]) -> pa.Array:
    return pa.array(histories, type=HISTORY_TYPE)


def histories_before(data: MovieLens, ends: list[int], window: int) -> list[list[dict]]:
    """Each user's events before index ends[u] (e.g. len(data.train(u)) for the validation item,
    len(data.seen_before_test(u)) for the test item), the last `window` at most."""
    return [data.events(u, end, window) for u, end in enumerate(ends)]


@dataclass
class UserEvents:
    """Per user, aligned with `MovieLens.histories`: item rows, actions and each event's gap bucket."""

    items: list[np.ndarray]
    actions: list[np.ndarray]
    buckets: list[np.ndarray]  # the first event's is the unknown bucket
    unknown_bucket: int
    no_action: int


def user_events(data: MovieLens, config: HSTUConfig) -> UserEvents:
    """Item rows are MovieLens item indices (the ranker's catalog is `data.item_ids` in order)."""
    actions = [np.asarray(r, dtype=np.int64) - 1 for r in data.ratings]
    buckets = [np.asarray(config.time_buckets(t.tolist()), dtype=np.int64) for t in data.timestamps]
    return UserEvents(list(data.histories), actions, buckets, config.unknown_bucket, config.no_action)


@dataclass
class RankBatch:
    """B rows: a history of `lengths[b]` events (right-padded to W), then candidates [B, C] at position lengths[b]."""

    items: torch.Tensor  # [B, W]
    actions: torch.Tensor  # [B, W]
    buckets: torch.Tensor  # [B, W]
    lengths: torch.Tensor  # [B]
    candidates: torch.Tensor  # [B, C] item rows


def make_rank_batch(events: UserEvents, rows: list[tuple[int, int]], candidates: np.ndarray, window: int) -> RankBatch:
    """rows: (user, end): the history is the user's events before index `end`, the last `window` at most."""
    spans = [(u, max(0, end - window), end) for u, end in rows]
    width = max(end - start for _, start, end in spans)
    items = np.zeros((len(rows), width), dtype=np.int64)
    actions = np.full_like(items, events.no_action)
    buckets = np.full_like(items, events.unknown_bucket)
    for b, (u, start, end) in enumerate(spans):
        n = end - start
        items[b, :n] = events.items[u][start:end]
        actions[b, :n] = events.actions[u][start:end]
        buckets[b, 1:n] = events.buckets[u][start + 1 : end]  # the first keeps the unknown bucket
    lengths = np.array([end - start for _, start, end in spans], dtype=np.int64)
    return RankBatch(*(torch.from_numpy(a) for a in (items, actions, buckets, lengths, np.asarray(candidates))))
