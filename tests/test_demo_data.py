"""MovieLens-100k from the recbole wheel: leave-last-out split with a stable time order."""

import csv

import numpy as np
import pytest

from genrec_demo.data import load_movielens, movielens_dir
from genrec_demo.factors import svd_factors


@pytest.fixture(scope="module")
def movielens():
    return load_movielens()


def test_sizes_and_titles(movielens):
    assert len(movielens.user_ids) == 943 and movielens.num_items == 1682
    assert sum(len(h) for h in movielens.histories) == 100_000
    assert movielens.titles[0] == "Toy Story (1995)"


def test_held_out_items_follow_time_then_file_order(movielens):
    """415 users rate their last two movies in the same second: the later row in the file is the test item."""
    rows: dict[str, list[tuple[float, int, str]]] = {}
    with (movielens_dir() / "ml-100k.inter").open() as f:
        for line, row in enumerate(csv.DictReader(f, delimiter="\t")):
            rows.setdefault(row["user_id:token"], []).append(
                (float(row["timestamp:float"]), line, row["item_id:token"])
            )
    ties = 0
    for u, user in enumerate(movielens.user_ids):
        ordered = sorted(rows[user])  # by time, then by line in the file
        ties += ordered[-1][0] == ordered[-2][0]
        assert movielens.item_ids[movielens.test(u)] == ordered[-1][2]
        assert movielens.item_ids[movielens.valid(u)] == ordered[-2][2]
        assert len(movielens.train(u)) == len(ordered) - 2
    assert ties == 415


def test_popularity_excludes_test_items(movielens):
    counts = np.bincount(np.concatenate(movielens.histories), minlength=movielens.num_items)
    tests = np.bincount([movielens.test(u) for u in range(943)], minlength=movielens.num_items)
    assert (movielens.popularity == counts - tests).all()


def test_svd_factors_are_unit_rows_from_training_items_only(movielens):
    small = movielens.head(50)
    factors = svd_factors(small, rank=8)
    assert factors.items.shape == (1682, 8) and factors.users.shape == (50, 8)
    assert np.allclose(np.linalg.norm(factors.users, axis=1), 1.0, atol=1e-5)
    trained = np.unique(np.concatenate([small.train(u) for u in range(50)]))
    norms = np.linalg.norm(factors.items, axis=1)
    assert np.allclose(norms[trained], 1.0, atol=1e-4)
    assert np.allclose(np.delete(norms, trained), 0.0)  # never trained on: no vector


def test_svd_factors_keep_their_rank_on_a_slice_smaller_than_it(movielens):
    """5 users give at most 5 factors: vectors stay `rank` long (the cache and the projector expect it)."""
    factors = svd_factors(movielens.head(5), rank=8)
    assert factors.users.shape == (5, 8) and factors.items.shape == (1682, 8)
    assert (factors.users[:, 5:] == 0).all()
