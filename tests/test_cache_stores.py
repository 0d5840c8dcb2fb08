"""One test suite for every backing store (a real SQLite file, a real redis-server), plus bulk load."""

import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from genrec.cache import EmbeddingTable, RedisStore, SQLiteStore, load_parquet

DIM = 8


@pytest.fixture(params=["sqlite", "redis"])
def make_store(request, tmp_path):
    opened, prefix = [], f"test:{uuid.uuid4().hex}:"

    def make():
        if request.param == "sqlite":
            store = SQLiteStore(tmp_path / "emb.sqlite", DIM)
        else:
            store = RedisStore(request.getfixturevalue("redis_url"), DIM, prefix=prefix)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def data(n, seed=0):
    return np.random.default_rng(seed).normal(size=(n, DIM)).astype(np.float32)


def test_round_trip_is_bit_exact(make_store):
    store = make_store()
    keys = np.array([3, -7, 10**15, 42])
    vectors = data(4)
    store.put_many(keys, vectors)
    got, found = store.get_many(np.array([42, 99, 3, -7, 10**15]))
    assert found.tolist() == [True, False, True, True, True]
    assert got[[0, 2, 3, 4]].tobytes() == vectors[[3, 0, 1, 2]].tobytes()


def test_overwrite_and_empty_batches(make_store):
    store = make_store()
    store.put_many(np.array([1]), data(1))
    store.put_many(np.array([1]), data(1, seed=5))
    got, found = store.get_many(np.array([1]))
    assert found.all() and np.array_equal(got, data(1, seed=5))
    got, found = store.get_many(np.zeros(0, dtype=np.int64))
    assert got.shape == (0, DIM) and found.shape == (0,)


def test_acknowledged_writes_survive_reopening(make_store):
    first = make_store()
    first.put_many(np.arange(500), data(500))
    first.close()
    got, found = make_store().get_many(np.arange(500))
    assert found.all() and got.tobytes() == data(500).tobytes()


def test_table_reads_and_writes_through(make_store):
    store = make_store()
    store.put_many(np.array([1, 2]), data(2))
    table = EmbeddingTable(DIM, capacity=10, store=store)
    got, found = table.get([2, 1, 5])
    assert found.tolist() == [True, True, False] and np.array_equal(got[:2], data(2)[[1, 0]])
    assert table.stats.store_hits == 2 and sorted(table.resident_keys().tolist()) == [1, 2]
    table.put([9], data(1, seed=9))
    assert store.get_many(np.array([9]))[1].all()


def test_bulk_load_from_parquet(make_store, tmp_path):
    ids = [f"user-{i}" for i in range(1000)]
    path = tmp_path / "users.parquet"
    pq.write_table(pa.table({"user_id": ids, "embedding": data(1000).tolist()}), path, row_group_size=300)
    store = make_store()
    assert load_parquet(path, store, batch_rows=256) == 1000
    table = EmbeddingTable(DIM, capacity=100, store=store)
    got, found = table.get(ids[::-1])
    assert found.all() and np.array_equal(got, data(1000)[::-1])


def test_bulk_load_rejects_bad_files(make_store, tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"user_id": [1, 2], "embedding": [[1.0] * DIM, [1.0] * (DIM - 1)]}), path)
    with pytest.raises(ValueError, match=f"{DIM} values"):
        load_parquet(path, make_store())
    pq.write_table(pa.table({"id": [1]}), path)
    with pytest.raises(ValueError, match="user_id"):
        load_parquet(path, make_store())
