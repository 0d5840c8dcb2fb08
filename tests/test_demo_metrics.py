"""Demo metrics on a hand-computed example."""

import math

import numpy as np
import pyarrow as pa
import pytest

from genrec.api import RecommendedItem
from genrec_demo.calibrate import best_weight, measure_weights
from genrec_demo.data import MovieLens
from genrec_demo.evaluate import rankings_from_rows, retrieve_order
from genrec_demo.metrics import hit_ranks, mrr, ndcg_at, paired, popularity_rankings, recall_at


def test_ranks_recall_and_ndcg_by_hand():
    rankings = np.array([[5, 3, 9], [1, 2, 3], [7, 8, -1]])
    ranks = hit_ranks(rankings, np.array([3, 4, 7]))
    assert ranks.tolist() == [1, 3, 0]  # second user's item is absent: rank = depth
    assert recall_at(ranks, 1) == pytest.approx(1 / 3)
    assert recall_at(ranks, 2) == pytest.approx(2 / 3)
    assert recall_at(ranks, 3) == pytest.approx(2 / 3)
    assert ndcg_at(ranks, 1) == pytest.approx(1 / 3)
    assert ndcg_at(ranks, 2) == pytest.approx((1 / math.log2(3) + 0 + 1) / 3)  # 0.5436
    assert mrr(ranks, 3) == pytest.approx((1 / 2 + 0 + 1) / 3)
    assert mrr(ranks, 1) == pytest.approx(1 / 3)  # only rank 0 is within a depth of 1


def test_popularity_ranks_unseen_items_most_popular_first():
    popularity = np.array([5, 9, 9, 1, 0])
    out = popularity_rankings(popularity, [np.array([2]), np.array([1, 2, 0, 3])], k=2)
    assert out.tolist() == [[1, 0], [4, -1]]  # ties keep the lower index first; -1 pads a short list


def test_retrieve_order_sorts_retrieved_items_by_beam_logprob_and_drops_given_ones():
    items = ["a", "b", "c", "d"]  # recommend's order (by score)
    assert retrieve_order(items, [-2.0, None, -1.0, -2.0]) == ["c", "a", "d"]  # ties keep the score order


def test_two_stage_rows_give_the_ranker_the_label_rerank_and_the_beam_order():
    data = MovieLens(["u1", "u2"], ["a", "b", "c", "d"], ["A", "B", "C", "D"], [np.array([0, 1, 2])] * 2)
    rows = pa.table(
        {
            "user_id": ["u1"] * 3 + ["u2"],
            "rank": [1, 2, 3, 1],  # the ranker's order
            "retrieval_rank": [3, 1, 2, 1],  # stage 1's (the label rerank)
            "item_id": ["c", "a", "d", "b"],
            "retrieval_logprob": [-0.5, -3.0, -1.0, -2.0],  # the beam order
        }
    )
    out = rankings_from_rows(rows, data, depth=3)
    index = {"a": 0, "b": 1, "c": 2, "d": 3}
    assert out["ranker"][0].tolist() == [index[i] for i in "cad"]
    assert out["recommend"][0].tolist() == [index[i] for i in "adc"]
    assert out["retrieve"][0].tolist() == [index[i] for i in "cda"]
    assert out["ranker"][1].tolist() == [index["b"], -1, -1]


def test_score_weights_measured_on_a_hand_computed_example():
    """User a: the target is last by code logprob and first by score; user b: the other way round."""

    def item(item_id, code, score):
        return RecommendedItem(item_id=item_id, code_logprob=code, score_logprob=score, prob=0.5, source="retrieved")

    a = [item(f"a{k}", -k, -5.0) for k in range(1, 12)] + [item("a", -12.2, 0.0)]
    b = [item(f"b{k}", -k, 0.0) for k in range(1, 12)] + [item("b", -0.6, -10.0)]
    measured = measure_weights([a, b], ["a", "b"], weights=(0.0, 0.25, 0.5, 1.0, 2.0))
    # key = code + w * score: a's rank is #{k < 12.2 - 5w}, b's is #{k < 0.6 + 10w} (a hit below 10)
    ranks = {0.0: (11, 0), 0.25: (10, 3), 0.5: (9, 5), 1.0: (7, 10), 2.0: (2, 11)}
    for weight, (rank_a, rank_b) in ranks.items():
        gains = [1 / np.log2(r + 2) if r < 10 else 0.0 for r in (rank_a, rank_b)]
        assert measured[weight] == pytest.approx(((rank_a < 10) / 2 + (rank_b < 10) / 2, sum(gains) / 2))
    assert best_weight(measured) == 0.5
    assert best_weight({0.0: (0.5, 0.3), 0.25: (0.5, 0.3), 1.0: (0.5, 0.2)}) == 0.0  # ties: the smaller weight


def test_paired_counts_users_gained_and_lost_and_the_mean_difference():
    ranks = np.array([0, 12, 3, 50, 9])
    baseline = np.array([1, 2, 3, 8, 20])
    out = paired(ranks, baseline, k=10)
    gains = lambda r: np.where(r < 10, 1 / np.log2(r + 2.0), 0.0)  # noqa: E731
    diff = gains(ranks) - gains(baseline)
    assert out["ndcg@10 difference"] == round(diff.mean(), 4)
    assert out["standard error"] == round(diff.std(ddof=1) / np.sqrt(5), 4)
    assert (out["users gained"], out["users lost"]) == (1, 2)  # user 4 gains it; users 1 and 3 lose it
