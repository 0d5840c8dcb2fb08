"""EmbeddingTable: batched get/put, score-based eviction, admission, bad input."""

import tracemalloc

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from genrec.cache import EmbeddingTable, SQLiteStore
from genrec.cache.hash_index import HashIndex
from genrec.cache.keys import normalize_keys
from genrec.errors import CacheError


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


MASK = (1 << 64) - 1


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def reference_key(text: str) -> int:
    """The string hash, one string and one word at a time (the stored format: keys in stores depend on it)."""
    data = text.encode()
    total = 0
    for word_index, start in enumerate(range(0, len(data), 8)):
        word = int.from_bytes(data[start : start + 8], "little")
        total = (total + _mix(word ^ ((word_index * 0x9E3779B97F4A7C15) & MASK))) & MASK
    key = _mix((total + _mix(len(data) ^ 0x632BE59BD9B4E019)) & MASK)
    key = key - (1 << 64) if key >= 1 << 63 else key
    return key + 2 if key <= -(1 << 63) + 1 else key


def test_string_keys_match_the_reference_and_include_the_length():
    rng = np.random.default_rng(7)
    alphabet = list("ab\x00é€😀") + [chr(c) for c in range(32, 127)]
    strings = ["", "ab", "ab\x00", "\x00", "a" * 8, "a" * 9, "a" * 16, "x" * 1000]
    strings += ["".join(rng.choice(alphabet, size=rng.integers(0, 40))) for _ in range(500)]
    assert normalize_keys(strings).tolist() == [reference_key(s) for s in strings]
    assert normalize_keys(["ab", "ab\x00"])[0] != normalize_keys(["ab", "ab\x00"])[1]
    # Every input form of the same strings gives the same keys: a list, numpy, Arrow (sliced, chunked), pandas.
    plain = ["alice", "bob", "émile", "a\x00b"]
    expected = normalize_keys(plain).tolist()
    for form in (
        np.array(plain),
        np.array(plain, dtype=object),
        pa.array(["x", *plain]).slice(1),
        pa.chunked_array([plain[:1], plain[1:]]),
        pd.Series(plain),
    ):
        assert normalize_keys(form).tolist() == expected


def test_one_long_id_does_not_slow_its_batch():
    """Issue 13 item 21: a 200,000-character ID in a 1,000-ID batch took 6.5 s (padding every ID to it, 200 MB
    here): the work and the memory are linear in the total bytes."""
    ids = ["x" * 200_000] + [f"user-{i}" for i in range(999)]
    tracemalloc.start()
    try:
        keys = normalize_keys(ids)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 << 20
    assert keys[0] == reference_key(ids[0]) and keys[1:].tolist() == normalize_keys(ids[1:]).tolist()


def test_integer_ids_in_any_container_are_their_own_keys():
    for form in ([3, -7, 10**15], np.array([3, -7, 10**15], dtype=object), pd.Series([3, -7, 10**15], dtype=object)):
        assert normalize_keys(form).tolist() == [3, -7, 10**15]
    table = EmbeddingTable(dim=4, capacity=10)
    table.put([3], vectors(1))
    assert table.get(pd.Series([3], dtype=object).to_numpy())[1].tolist() == [True]


@pytest.mark.parametrize(
    "ids, problem",
    [
        (["a", None], "None"),
        ([1, None], "None"),
        (np.array(["a", 1], dtype=object), "all integers or all strings"),
        (["a", 1], "all integers or all strings"),
        (["\ud800abc"], "not valid Unicode"),
        ([2**63], "int64"),
        (np.array([2**63], dtype=np.uint64), "int64"),
        ([1.5], "integers or strings"),
        ([True, False], "integers or strings"),
        ([b"raw"], "integers or strings"),
        ([[1, 2]], "integers or strings"),
        (np.zeros((2, 2), dtype=np.int64), "one-dimensional"),
        ("alice", "one string"),
        ([int(np.iinfo(np.int64).min)], "reserved"),
    ],
)
def test_bad_ids_are_refused_with_a_clear_error(ids, problem):
    with pytest.raises(CacheError, match=problem):
        normalize_keys(ids)


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
    with pytest.raises(ValueError, match="non-finite"):
        table.put([1], np.full((1, 4), 1e39))  # finite in float64, infinite in float32
    with pytest.raises(ValueError, match="numeric"):
        table.put([1], [["a"] * 4])
    with pytest.raises(ValueError, match="numeric"):
        table.put([1, 2], [[1.0] * 4, [1.0] * 3])  # ragged
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


def test_admission_gates_read_through_fills_only(tmp_path):
    store = SQLiteStore(tmp_path / "emb.sqlite", 4)
    data = vectors(1)
    store.put_many([5], data)
    table = EmbeddingTable(dim=4, capacity=10, admit_after=3, store=store)
    for resident_after in (False, False, True):  # the third miss admits the key
        got, found = table.get([5])
        assert found.tolist() == [True] and np.array_equal(got, data)
        assert (5 in table.resident_keys()) == resident_after
    assert table.stats.admissions_refused == 2 and table.stats.store_hits == 3


@pytest.mark.parametrize("with_store", [False, True])
def test_an_acknowledged_put_is_readable_whatever_the_admission(tmp_path, with_store):
    """Issue 13 item 19: admit_after=2 with no store acknowledged a put and then dropped it."""
    store = SQLiteStore(tmp_path / "emb.sqlite", 4) if with_store else None
    table = EmbeddingTable(dim=4, capacity=10, admit_after=2, store=store)
    data = vectors(3)
    assert table.put([1, 2, 3], data) == 3
    got, found = table.get([3, 1, 2])
    assert found.all() and np.array_equal(got, data[[2, 0, 1]])
    assert table.stats.store_hits == 0  # served from the table itself


@pytest.mark.parametrize("policy", ["lru", "lfu", "decayed_lfu"])
def test_a_put_does_not_evict_its_own_keys(policy):
    """Key 1 is popular; a put of resident key 2 and new key 3 into a full table must keep both 2 and 3."""
    table = EmbeddingTable(dim=4, capacity=2, policy=policy)
    table.put([1, 2], vectors(2))
    for _ in range(10):
        table.get([1])
    data = vectors(2, seed=1)
    table.put([2, 3], data)
    got, found = table.get([2, 3])
    assert found.all() and np.array_equal(got, data)
    assert sorted(table.resident_keys().tolist()) == [2, 3]


def test_capacity_is_bounded():
    table = EmbeddingTable(dim=2, capacity=50)
    for i in range(20):
        table.put(np.arange(i * 30, i * 30 + 30), vectors(30, dim=2, seed=i))
        assert len(table) <= 50
    assert len(table) == 50 and len(set(table.resident_keys().tolist())) == 50


@pytest.mark.parametrize(
    "options, problem",
    [
        ({"dim": 0}, "dim"),
        ({"dim": 2.5}, "dim"),
        ({"capacity": True}, "capacity"),
        ({"capacity": -1}, "capacity"),
        ({"admit_after": 0}, "admit_after"),
        ({"policy": "fifo"}, "policy"),
    ],
)
def test_bad_table_options_are_refused(options, problem):
    with pytest.raises(CacheError, match=problem):
        EmbeddingTable(**{"dim": 4, "capacity": 10, **options})


def test_a_store_of_another_width_is_refused(tmp_path):
    with pytest.raises(CacheError, match="8-d"):
        EmbeddingTable(dim=4, capacity=10, store=SQLiteStore(tmp_path / "emb.sqlite", 8))
