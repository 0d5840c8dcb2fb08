"""The demo's HSTU ranker: MovieLens events, the training split, determinism, and parity with the served Engine."""

import numpy as np
import pytest
import torch

from genrec.api import Event, RankRequest
from genrec.engine import Engine
from genrec_demo.data import MovieLens, load_movielens
from genrec_demo.factors import svd_factors
from genrec_demo.ranker import evaluate as ranker_evaluate
from genrec_demo.ranker import train as ranker_train
from genrec_demo.ranker.config import RankerConfig
from genrec_demo.ranker.events import HISTORY_TYPE, histories_before, history_array, make_rank_batch, user_events
from genrec_demo.ranker.forward import rank_logits
from genrec_demo.ranker.model_dir import prepare_ranker, read_ranker_recipe

TINY = RankerConfig(
    window=8, hidden=16, heads=2, head_dim=8, head_hidden=16, steps=4, batch=16, negatives=4, near=10, time_buckets=8
)


@pytest.fixture(scope="module")
def movielens():
    return load_movielens()


@pytest.fixture(scope="module")
def small(movielens):
    data = movielens.head(30)
    return data, svd_factors(data, 8)


def hand_made() -> MovieLens:
    """One user: items 3, 1, 2, 0 rated 5, 3, 1, 4 at t = 100, 101, 105, 200."""
    return MovieLens(
        ["u0"],
        ["a", "b", "c", "d"],
        ["A", "B", "C", "D"],
        [np.array([3, 1, 2, 0])],
        [np.array([5, 3, 1, 4])],
        [np.array([100.0, 101.0, 105.0, 200.0])],
    )


def test_events_before_an_index_the_last_window_oldest_first():
    data = hand_made()
    assert data.events(0, 3, window=2) == [
        {"item_id": "b", "action": 2, "timestamp": 101.0},
        {"item_id": "c", "action": 0, "timestamp": 105.0},
    ]
    assert [e["item_id"] for e in data.events(0, 4, window=10)] == ["d", "b", "c", "a"]
    assert data.events(0, 0, window=5) == []


def test_ratings_and_timestamps_align_with_the_file(movielens):
    """User 196's first event in the file is item 242, rated 3 at 881250949; head() keeps the events."""
    u = movielens.user_ids.index("196")
    history = movielens.events(u, len(movielens.histories[u]), window=10_000)
    assert {"item_id": "242", "action": 2, "timestamp": 881250949.0} in history
    assert [e["timestamp"] for e in history] == sorted(e["timestamp"] for e in history)
    assert all(0 <= e["action"] <= 4 for e in history)
    sliced = movielens.head(3)
    assert sliced.events(2, 5, 3) == movielens.events(2, 5, 3)


def test_a_batch_row_is_exactly_the_request_the_engine_would_get():
    data = hand_made()
    config = TINY.hstu_config(data.num_items)
    batch = make_rank_batch(user_events(data, config), [(0, 4), (0, 2)], np.array([[1, 2], [0, 3]]), window=3)
    assert batch.items.tolist() == [[1, 2, 0], [3, 1, 0]] and batch.lengths.tolist() == [3, 2]
    assert batch.actions.tolist() == [[2, 0, 3], [4, 2, config.no_action]]
    for row, (end, n) in enumerate([(4, 3), (2, 2)]):  # buckets as the engine computes them from the request
        expected = config.time_buckets([e["timestamp"] for e in data.events(0, end, 3)])
        assert batch.buckets[row, :n].tolist() == expected
    assert batch.buckets[0, 0] == config.unknown_bucket  # the window's first event: no gap to a known event


def test_training_sees_training_items_only(small, monkeypatch):
    data, factors = small
    seen = []

    def record(events, rows, candidates, window):
        seen.extend((u, max(0, t - window), t, int(c)) for (u, t), c in zip(rows, candidates[:, 0], strict=True))
        return make_rank_batch(events, rows, candidates, window)

    monkeypatch.setattr(ranker_train, "make_rank_batch", record)
    ranker_train.train_ranker(data, factors, TINY)
    assert len(seen) == TINY.steps * TINY.batch
    for u, start, t, target in seen:
        assert 1 <= t < len(data.train(u)) and start >= 0  # history and target inside the training items
        assert target == data.histories[u][t]
    rows = ranker_train.training_rows(data)
    assert len(rows) == sum(len(data.train(u)) - 1 for u in range(len(data.user_ids)))
    assert all(t < len(data.histories[u]) - 2 for u, t in rows)  # never the validation or test index


def test_same_seed_same_steps_same_weights(small):
    data, factors = small
    first, second = (ranker_train.train_ranker(data, factors, TINY).model.state_dict() for _ in range(2))
    assert all(torch.equal(first[name], second[name]) for name in first)
    other = ranker_train.train_ranker(data, factors, RankerConfig(**{**TINY.to_dict(), "seed": 1})).model
    assert not torch.equal(other.item_embedding.weight, first["item_embedding.weight"])


def test_item_embeddings_start_from_the_svd_item_factors(small):
    data, factors = small
    model = ranker_train.new_model(TINY, data.num_items, factors.items)
    rank = factors.items.shape[1]
    assert torch.equal(model.item_embedding.weight[:, :rank], torch.as_tensor(factors.items))
    assert model.item_embedding.weight[:, rank:].abs().max() < 1.0  # the other dims: small noise
    plain = ranker_train.new_model(TINY, data.num_items)
    assert not torch.allclose(plain.item_embedding.weight[:, :rank], torch.as_tensor(factors.items), atol=0.1)


@pytest.fixture(scope="module")
def ranker_dir(small, tmp_path_factory):
    data, factors = small
    out = tmp_path_factory.mktemp("ranker")
    recipe, reused = prepare_ranker(out, data, factors, TINY, say=lambda _: None)
    assert not reused and recipe["training"]["steps"] == TINY.steps
    return out


def test_the_served_engine_agrees_with_the_training_forward(small, ranker_dir):
    data, _ = small
    engine = Engine.from_pretrained(ranker_dir)
    model, rng = engine.model, np.random.default_rng(0)
    events = user_events(data, model.config)
    rows = [(int(u), int(rng.integers(1, len(data.histories[u]) + 1))) for u in rng.integers(0, 30, 12)]
    rows.append((0, 1))  # a one-event history
    candidates = rng.integers(0, data.num_items, (len(rows), 7))
    with torch.no_grad():
        expected = torch.sigmoid(rank_logits(model, make_rank_batch(events, rows, candidates, TINY.window)))
    requests = [
        RankRequest(
            history=[Event(**e) for e in data.events(u, end, TINY.window)],
            candidates=[data.item_ids[i] for i in cands],
        )
        for (u, end), cands in zip(rows, candidates, strict=True)
    ]
    results = engine.rank(requests)
    got = torch.tensor([[[item.scores[t] for t in model.config.tasks] for item in r.items] for r in results])
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_a_matching_recipe_is_reused_and_another_retrains(small, ranker_dir):
    data, factors = small
    recipe = read_ranker_recipe(ranker_dir)
    again, reused = prepare_ranker(ranker_dir, data, factors, TINY, say=lambda _: None)
    assert reused and again == recipe
    _, reused = prepare_ranker(ranker_dir, data.head(20), factors, TINY, say=lambda _: None)
    assert not reused and read_ranker_recipe(ranker_dir)["users"] == 20


def test_rank_retrieved_orders_by_watch_probability_in_batches(small, ranker_dir):
    data, _ = small
    engine = Engine.from_pretrained(ranker_dir)
    retrieved = [[data.item_ids[i] for i in range(10, 20)], [], [data.item_ids[i] for i in range(5)]]
    histories = [data.events(u, len(data.train(u)), TINY.window) for u in range(3)]
    orders = ranker_evaluate.rank_retrieved(engine, histories, retrieved, batch=2)
    assert orders[1] == [] and sorted(orders[0]) == sorted(retrieved[0])
    request = RankRequest(history=[Event(**e) for e in histories[2]], candidates=retrieved[2], tasks=["watch"])
    scores = {item.item_id: item.scores["watch"] for item in engine.rank([request])[0].items}
    assert orders[2] == sorted(retrieved[2], key=lambda i: -scores[i])
    assert ranker_evaluate.quality([["a", "b"], ["c"]], ["b", "x"], k=1) == {"recall@1": 0.0, "ndcg@1": 0.0}


def test_histories_make_the_batch_jobs_parquet_column():
    data = hand_made()
    histories = histories_before(data, [3], window=2)
    column = history_array(histories)
    assert column.type == HISTORY_TYPE and column.to_pylist() == histories
