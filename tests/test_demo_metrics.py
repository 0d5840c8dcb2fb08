"""Demo metrics on a hand-computed example."""

import math

import numpy as np
import pytest

from genrec.demo.evaluate import retrieve_order
from genrec.demo.metrics import hit_ranks, ndcg_at, popularity_rankings, recall_at


def test_ranks_recall_and_ndcg_by_hand():
    rankings = np.array([[5, 3, 9], [1, 2, 3], [7, 8, -1]])
    ranks = hit_ranks(rankings, np.array([3, 4, 7]))
    assert ranks.tolist() == [1, 3, 0]  # second user's item is absent: rank = depth
    assert recall_at(ranks, 1) == pytest.approx(1 / 3)
    assert recall_at(ranks, 2) == pytest.approx(2 / 3)
    assert recall_at(ranks, 3) == pytest.approx(2 / 3)
    assert ndcg_at(ranks, 1) == pytest.approx(1 / 3)
    assert ndcg_at(ranks, 2) == pytest.approx((1 / math.log2(3) + 0 + 1) / 3)  # 0.5436


def test_popularity_ranks_unseen_items_most_popular_first():
    popularity = np.array([5, 9, 9, 1, 0])
    out = popularity_rankings(popularity, [np.array([2]), np.array([1, 2, 0, 3])], k=2)
    assert out.tolist() == [[1, 0], [4, -1]]  # ties keep the lower index first; -1 pads a short list


def test_retrieve_order_sorts_retrieved_items_by_beam_logprob_and_drops_given_ones():
    items = ["a", "b", "c", "d"]  # recommend's order (by score)
    assert retrieve_order(items, [-2.0, None, -1.0, -2.0]) == ["c", "a", "d"]  # ties keep the score order
