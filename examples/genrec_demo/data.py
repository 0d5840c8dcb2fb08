"""MovieLens-100k, read from the files inside the installed `recbole` wheel (never imported, never copied).

MovieLens' terms forbid redistributing the data, so the demo reads it where pip put it. Each user's ratings,
sorted stably by time (415 users rate their last two movies in the same second: file order decides), are
split leave-last-out: the last one is the test item, the one before it validation, the rest training.
Each rating (1..5) and timestamp is kept aligned with `histories`: the ranker's history events.
"""

from __future__ import annotations

import csv
import importlib.util
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from genrec.errors import GenrecError

INSTALL_HINT = "pip install --no-deps recbole==1.2.1 (make install does it)"


def movielens_dir() -> Path:
    spec = importlib.util.find_spec("recbole")
    if spec is None or spec.origin is None:
        raise GenrecError(f"MovieLens-100k ships inside the recbole wheel, which is not installed: {INSTALL_HINT}")
    path = Path(spec.origin).parent / "dataset_example" / "ml-100k"
    if not (path / "ml-100k.inter").is_file() or not (path / "ml-100k.item").is_file():
        raise GenrecError(f"{path}: ml-100k.inter / ml-100k.item are missing; reinstall: {INSTALL_HINT}")
    return path


@dataclass
class MovieLens:
    """Users and items as dense indices; `histories[u]` is user u's item indices in time order."""

    user_ids: list[str]
    item_ids: list[str]
    titles: list[str]
    histories: list[np.ndarray]
    ratings: list[np.ndarray] | None = None  # aligned with histories: 1..5
    timestamps: list[np.ndarray] | None = None  # aligned with histories: seconds
    genres: list[list[str]] | None = None  # per item (MovieLens' classes: "Comedy", "Drama", ...)
    years: list[int | None] | None = None  # per item: its release year (None where the file has none)

    @property
    def num_items(self) -> int:
        return len(self.item_ids)

    def train(self, u: int) -> np.ndarray:
        return self.histories[u][:-2]

    def valid(self, u: int) -> int:
        return int(self.histories[u][-2])

    def test(self, u: int) -> int:
        return int(self.histories[u][-1])

    def seen_before_test(self, u: int) -> np.ndarray:
        return self.histories[u][:-1]

    @cached_property
    def popularity(self) -> np.ndarray:
        """Interactions per item, counting everything but the held-out test items."""
        seen = np.concatenate([self.seen_before_test(u) for u in range(len(self.user_ids))])
        return np.bincount(seen, minlength=self.num_items)

    def head(self, users: int) -> MovieLens:
        """The first `users` users (all items stay in the catalog): a fast slice for tests."""
        ratings = None if self.ratings is None else self.ratings[:users]
        timestamps = None if self.timestamps is None else self.timestamps[:users]
        histories = self.histories[:users]
        return MovieLens(
            self.user_ids[:users], self.item_ids, self.titles, histories, ratings, timestamps, self.genres, self.years
        )

    def events(self, u: int, end: int, window: int) -> list[dict]:
        """User u's events before index `end` of their history, the last `window` at most, oldest first, as a
        ranking request's history: {"item_id", "action" (rating - 1, 0..4), "timestamp"}."""
        if self.ratings is None or self.timestamps is None:
            raise GenrecError("this MovieLens has no ratings and timestamps (load it with load_movielens)")
        start = max(0, end - window)
        return [
            {"item_id": self.item_ids[i], "action": int(r) - 1, "timestamp": float(t)}
            for i, r, t in zip(
                self.histories[u][start:end], self.ratings[u][start:end], self.timestamps[u][start:end], strict=True
            )
        ]


def load_movielens(path: Path | None = None) -> MovieLens:
    path = path or movielens_dir()
    items = _read_tsv(path / "ml-100k.item")
    item_ids = [row["item_id:token"] for row in items]
    titles = [f"{row['movie_title:token_seq']} ({row['release_year:token']})" for row in items]
    genres = [row["class:token_seq"].split() for row in items]
    years = [int(row["release_year:token"]) if row["release_year:token"].isdigit() else None for row in items]
    item_index = {item: i for i, item in enumerate(item_ids)}
    inter = _read_tsv(path / "ml-100k.inter")
    users = np.array([row["user_id:token"] for row in inter])
    try:
        item = np.array([item_index[row["item_id:token"]] for row in inter])
    except KeyError as err:
        raise GenrecError(f"{path / 'ml-100k.inter'}: item {err} is not in ml-100k.item") from None
    time = np.array([float(row["timestamp:float"]) for row in inter])
    rating = np.array([int(float(row["rating:float"])) for row in inter])
    user_ids, user = np.unique(users, return_inverse=True)
    order = np.lexsort((time, user))  # by user, then time; lexsort is stable, so file order breaks ties
    bounds = np.searchsorted(user[order], np.arange(len(user_ids) + 1))
    spans = list(zip(bounds[:-1], bounds[1:], strict=True))
    histories = [item[order[a:b]] for a, b in spans]
    short = [user_ids[u] for u, h in enumerate(histories) if len(h) < 3]
    if short:
        raise GenrecError(f"{path}: users {short[:5]} have fewer than 3 ratings (need train, validation and test)")
    ratings = [rating[order[a:b]] for a, b in spans]
    timestamps = [time[order[a:b]] for a, b in spans]
    return MovieLens(user_ids.tolist(), item_ids, titles, histories, ratings, timestamps, genres, years)


def _read_tsv(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
