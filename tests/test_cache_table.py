"""EmbeddingTable: batched get/put, score-based eviction, admission, bad input."""

import numpy as np
import pytest

from genrec.cache import EmbeddingTable
from genrec.cache.hash_index import HashIndex
from genrec.cache.keys import normalize_keys


def vectors(n, dim=4, seed=0):
    return np.random.default_rng(seed).normal(size=(n, dim)).astype(np.float32)


def test_hash_index_against_a_dict():
    rng = np.random.default_rng(3)
    index, truth = HashIndex(5000), {}
    for _ in range(30):
        new = np.setdiff1d(np.unique(rng.integers(-(10**12), 10**12, size=300)), np.fromiter(truth, np.int64))
        rows = rng.integers(0, 10**6, size=len(new))
        index.insert(new, rows)
        truth.update(zip(new.tolist(), rows.tolist(), strict=True))
        gone = rng.choice(np.fromiter(truth, np.int64), size=100, replace=False)
        index.remove(gone)
        for k in gone.tolist():
            del truth[k]
        probe = np.concatenate([np.fromiter(truth, np.int64)[:200], rng.integers(0, 10**12, size=50)])
        assert index.lookup(probe).tolist() == [truth.get(k, -1) for k in probe.tolist()]


def test_get_returns_what_was_put_and_flags_unknown_ids():
    table = EmbeddingTable(dim=4, capacity=100)
    data = vectors(10)
    table.put(np.arange(10), data)
    got, found = table.get([3, 42, 0, 9])
    assert found.tolist() == [True, False, True, True]
    assert np.array_equal(got[[0, 2, 3]], data[[3, 0, 9]]) and not got[1].any()


def test_string_and_integer_ids():
    table = EmbeddingTable(dim=4, capacity=100)
    table.put(["alice", "bob", "émile"], vectors(3))
    _, found = table.get(["bob", "carol", "émile", "alice"])
    assert found.tolist() == [True, False, True, True]
    assert len(set(normalize_keys([f"user-{i}" for i in range(100000)]).tolist())) == 100000


def test_duplicate_ids_in_one_put_last_wins():
    table = EmbeddingTable(dim=4, capacity=10)
    data = vectors(3)
    assert table.put([7, 8, 7], data) == 2
    got, _ = table.get([7, 8])
    assert np.array_equal(got, data[[2, 1]])


def test_bad_input():
    table = EmbeddingTable(dim=4, capacity=10)
    with pytest.raises(ValueError, match="shape"):
        table.put([1, 2], vectors(2, dim=3))
    with pytest.raises(ValueError, match="shape"):
        table.put([1, 2], vectors(3))
    bad = vectors(2)
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        table.put([1, 2], bad)
    bad[1, 2] = np.inf
    with pytest.raises(ValueError, match="non-finite"):
        table.put([1, 2], bad)
    assert table.put([], np.zeros((0, 4))) == 0
    got, found = table.get([])
    assert got.shape == (0, 4) and found.shape == (0,)
    with pytest.raises(ValueError, match="integers or strings"):
        table.get([1.5])
    assert len(table) == 0


@pytest.mark.parametrize("policy", ["lru", "lfu", "decayed_lfu"])
def test_eviction_keeps_the_highest_scoring_keys(policy):
    table = EmbeddingTable(dim=4, capacity=4, policy=policy)
    table.put([1, 2, 3, 4], vectors(4))
    # Key 3 and 1 are read often (and recently); 2 and 4 once, long ago.
    for _ in range(5):
        table.get([3, 1])
    table.put([10, 11], vectors(2, seed=1))  # two new keys: two evictions
    assert sorted(table.resident_keys().tolist()) == [1, 3, 10, 11]
    assert table.stats.evictions == 2


def test_lru_and_lfu_differ():
    """Frequent-but-old vs recent-but-rare: LRU keeps the recent key, LFU the frequent one."""
    kept = {}
    for policy in ("lru", "lfu"):
        table = EmbeddingTable(dim=4, capacity=2, policy=policy)
        table.put([1, 2], vectors(2))
        for _ in range(10):
            table.get([1])
        table.get([2])
        table.put([3], vectors(1))
        kept[policy] = sorted(table.resident_keys().tolist())
    assert kept == {"lru": [2, 3], "lfu": [1, 3]}


def test_decayed_lfu_forgets_old_popularity():
    table = EmbeddingTable(dim=4, capacity=2, policy="decayed_lfu", half_life=2.0)
    table.put([1, 2], vectors(2))
    for _ in range(6):
        table.get([1])  # popular early
    for _ in range(20):
        table.get([2])  # then key 2, for a long while
    table.put([3], vectors(1))
    assert sorted(table.resident_keys().tolist()) == [2, 3]


def test_admission_threshold_holds():
    table = EmbeddingTable(dim=4, capacity=10, admit_after=3)
    data = vectors(1)
    table.put([5], data)  # first miss: not admitted
    table.put([5], data)  # second
    assert table.get([5])[1].tolist() == [False]  # third miss... counted by the get
    table.put([5], data)  # fourth: admitted
    got, found = table.get([5])
    assert found.tolist() == [True] and np.array_equal(got, data)
    assert table.stats.admissions_refused == 2


def test_capacity_is_bounded():
    table = EmbeddingTable(dim=2, capacity=50)
    for i in range(20):
        table.put(np.arange(i * 30, i * 30 + 30), vectors(30, dim=2, seed=i))
        assert len(table) <= 50
    assert len(table) == 50 and len(set(table.resident_keys().tolist())) == 50
