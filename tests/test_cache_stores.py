"""One test suite for every backing store (a real SQLite file, a real redis-server), plus bulk load."""

import sqlite3
import threading
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from genrec.cache import EmbeddingTable, RedisStore, SQLiteStore, load_parquet
from genrec.errors import CacheError, StoreError

DIM = 8


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.integration)])
def make_store(request, tmp_path):
    opened, prefix = [], f"test:{uuid.uuid4().hex}:"

    def make(dim=DIM):
        if request.param == "sqlite":
            store = SQLiteStore(tmp_path / "emb.sqlite", dim)
        else:
            store = RedisStore(request.getfixturevalue("redis_url"), dim, prefix=prefix)
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


@pytest.mark.parametrize(
    "vectors, problem",
    [
        (np.ones((2, DIM - 1)), "shape"),  # another width: issue 13 item 15
        (np.ones((3, DIM)), "shape"),  # more rows than IDs
        (np.ones((1, DIM)), "shape"),  # fewer
        (np.ones(2 * DIM), "shape"),  # flat
        (np.array([[np.nan] * DIM, [1.0] * DIM]), "non-finite"),
        (np.array([[np.inf] * DIM, [1.0] * DIM]), "non-finite"),
        ([["x"] * DIM] * 2, "numeric"),
    ],
)
def test_bad_writes_are_refused_and_leave_the_store_clean(make_store, vectors, problem):
    store = make_store()
    store.put_many([1], data(1))
    with pytest.raises(CacheError, match=problem):
        store.put_many([1, 2], vectors)
    got, found = store.get_many([1, 2])  # neither poisoned nor half-written
    assert found.tolist() == [True, False] and np.array_equal(got[0], data(1)[0])


def test_reopening_with_another_dim_is_refused(make_store):
    make_store().put_many([1], data(1))
    with pytest.raises(StoreError, match=f"holds {DIM}-d vectors"):
        make_store(dim=DIM + 1)
    assert make_store().get_many([1])[1].all()  # the right width still opens


def test_a_sqlite_file_from_before_the_width_record(tmp_path):
    """Files written before the store recorded its width are checked row by row once, then adopted."""
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE embeddings (key INTEGER PRIMARY KEY, vec BLOB NOT NULL)")
        db.executemany("INSERT INTO embeddings VALUES (?, ?)", [(1, data(1).tobytes()), (2, b"\0" * 12)])
    with pytest.raises(StoreError, match=f"1 stored vectors are not {DIM}"):
        SQLiteStore(path, DIM)
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM embeddings WHERE key = 2")
    store = SQLiteStore(path, DIM)
    assert store.get_many([1])[1].all()
    store.close()
    with pytest.raises(StoreError, match=f"holds {DIM}-d"):
        SQLiteStore(path, 2 * DIM)


def test_a_key_asked_twice_is_found_twice(make_store):
    """Issue 13 item 16: SQLite answered found=[False, True, True] for [1, 1, 2]."""
    store = make_store()
    store.put_many([1, 2], data(2))
    got, found = store.get_many([1, 1, 2, 3, 1])
    assert found.tolist() == [True, True, True, False, True]
    assert np.array_equal(got[[0, 1, 2, 4]], data(2)[[0, 0, 1, 0]])


def test_string_ids_go_straight_to_a_store(make_store):
    store = make_store()
    store.put_many(["alice", "bob"], data(2))
    table = EmbeddingTable(DIM, capacity=10, store=store)  # the table hashes IDs the same way
    got, found = table.get(["bob", "alice", "carol"])
    assert found.tolist() == [True, True, False] and np.array_equal(got[:2], data(2)[[1, 0]])


def test_threads_can_share_one_store(make_store):
    """Issue 13 item 17: eight threads lost rows and raised "cannot start a transaction within a transaction"."""
    store, errors = make_store(), []
    threads, puts, rows = 8, 60, 10

    def writer(t):
        try:
            for i in range(puts):
                keys = np.arange(rows) + (t * puts + i) * rows
                store.put_many(keys, np.repeat(keys[:, None], DIM, axis=1))
                got, found = store.get_many(keys)  # reads interleave with the other threads' writes
                assert found.all() and np.array_equal(got[:, 0], keys)
        except Exception as e:  # surfaced below: a thread's exception would otherwise vanish
            errors.append(e)

    workers = [threading.Thread(target=writer, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == []
    every = np.arange(threads * puts * rows)
    got, found = store.get_many(every)
    assert found.all() and np.array_equal(got, np.repeat(every[:, None], DIM, axis=1).astype(np.float32))


def test_an_unreachable_redis_fails_at_open():
    with pytest.raises(StoreError, match="redis at redis://127.0.0.1:1/0"):
        RedisStore("redis://127.0.0.1:1/0", DIM)
    with pytest.raises(CacheError, match="redis_url"):
        RedisStore("http://127.0.0.1:1/0", DIM)


def test_an_unopenable_sqlite_file_is_a_store_error(tmp_path):
    (tmp_path / "not.sqlite").write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="not.sqlite"):
        SQLiteStore(tmp_path / "not.sqlite", DIM)


def test_an_empty_sqlite_file_is_refused_not_taken_for_a_new_store(tmp_path):
    """A 0-byte file (a truncated copy, a `touch`) would open as an empty store and lose every row silently."""
    (tmp_path / "emb.sqlite").touch()
    with pytest.raises(StoreError, match="emb.sqlite is empty"):
        SQLiteStore(tmp_path / "emb.sqlite", DIM)


def test_a_store_opened_for_another_cache_or_shard_count_is_refused(tmp_path):
    """Two caches on one default path would read each other's users; a cache reopened with more shards would route
    half its users to a new, empty file. The first opener's name and shard are recorded and checked."""
    path = tmp_path / "emb.sqlite"
    store = SQLiteStore(path, DIM, owner="cache 'a' shard 0 of 1")
    store.put_many([1], data(1))
    store.close()
    for other in ("cache 'b' shard 0 of 1", "cache 'a' shard 0 of 2"):
        with pytest.raises(StoreError, match=f"holds cache 'a' shard 0 of 1, not {other}: .*own store_path.*shards"):
            SQLiteStore(path, DIM, owner=other)
    again = SQLiteStore(path, DIM, owner="cache 'a' shard 0 of 1")
    assert again.get_many([1])[1].all()
    again.close()


@pytest.mark.integration
def test_a_redis_prefix_is_one_caches(redis_url):
    prefix = f"test:{uuid.uuid4().hex}:"
    RedisStore(redis_url, DIM, prefix=prefix, owner="a").close()
    with pytest.raises(StoreError, match="holds cache 'a', not 'b': give each cache its own redis_url database"):
        RedisStore(redis_url, DIM, prefix=prefix, owner="b")


@pytest.mark.integration
def test_a_redis_server_that_does_not_log_writes_is_refused(redis_url, tmp_path):
    """A stock redis-server keeps writes in memory only: a crash loses acknowledged puts, which the store promises
    to keep. (The suite's own server logs every write: genrec_bench.cache.LocalRedis.)"""
    import shutil
    import subprocess

    from genrec_bench.cache import _wait_for
    from genrec_bench.common import free_port

    port = free_port()
    command = [
        shutil.which("redis-server"),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--dir",
        tmp_path,
    ]
    server = subprocess.Popen([*map(str, command), "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        _wait_for(port)
        with pytest.raises(StoreError, match=r"does not log writes \(appendonly no\)"):
            RedisStore(f"redis://127.0.0.1:{port}/0", DIM)
    finally:
        server.terminate()
        server.wait(10)


def _write(path, **columns):
    pq.write_table(pa.table(columns), path)
    return path


def test_bulk_load_takes_fixed_size_and_float64_lists(make_store, tmp_path):
    vectors = data(3)
    fixed = pa.array(vectors.tolist(), pa.list_(pa.float32(), DIM))
    store = make_store()
    assert load_parquet(_write(tmp_path / "fixed.parquet", user_id=[1, 2, 3], embedding=fixed), store) == 3
    wide = pa.array(vectors.astype(np.float64).tolist(), pa.large_list(pa.float64()))
    assert load_parquet(_write(tmp_path / "f64.parquet", user_id=["a", "b", "c"], embedding=wide), store) == 3
    for ids in ([1, 2, 3], ["a", "b", "c"]):
        got, found = store.get_many(ids)
        assert found.all() and np.array_equal(got, vectors)


@pytest.mark.parametrize(
    "columns, problem",
    [
        # Ragged rows whose total is still 2 x DIM were re-chunked into other rows' vectors (item 18).
        (
            {"user_id": [1, 2], "embedding": [[1.0] * (DIM - 1), [1.0] * (DIM + 1)]},
            f"row 0 has an embedding of {DIM - 1}",
        ),
        ({"user_id": [1, 2], "embedding": [[1.0] * DIM, [1.0] * (DIM - 1)]}, f"must have {DIM} values"),
        (
            {"user_id": ["a", None, None], "embedding": [[1.0] * DIM] * 3},
            r"2 rows have a null 'user_id' \(the first: row 1\)",
        ),
        ({"user_id": [1, 2], "embedding": [[1.0] * DIM, None]}, "null 'embedding'"),
        ({"user_id": [1], "embedding": ["0.1 0.2"]}, "column 'embedding' must be a list of floats, got string"),
        ({"user_id": [1.5], "embedding": [[1.0] * DIM]}, "column 'user_id' must hold integers or strings, got double"),
        ({"user_id": [1], "embedding": pa.array([[1.0] * 3], pa.list_(pa.float32(), 3))}, "holds 3 values a row"),
        ({"user_id": [1, 2], "embedding": [[1.0] * DIM, [np.nan] * DIM]}, "row 1 has a non-finite"),
        ({"user_id": [1], "embedding": [[1.0] * (DIM - 1) + [None]]}, "row 0 has a non-finite"),
        ({"id": [1]}, "column 'user_id' is missing"),
    ],
)
def test_bulk_load_rejects_bad_files(make_store, tmp_path, columns, problem):
    store = make_store()
    with pytest.raises(CacheError, match=problem):
        load_parquet(_write(tmp_path / "bad.parquet", **columns), store)
    assert not store.get_many([1, 2])[1].any() and not store.get_many(["a"])[1].any()


def test_bulk_load_of_a_file_that_is_not_parquet(make_store, tmp_path):
    (tmp_path / "users.parquet").write_text("user_id,embedding\n")
    with pytest.raises(CacheError, match="not a readable Parquet file"):
        load_parquet(tmp_path / "users.parquet", make_store())
