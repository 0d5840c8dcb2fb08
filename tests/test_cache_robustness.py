"""Randomized robustness of the table and the stores (issue 13): seeded batches of good and bad input.

IDs: integers (negative, huge, int64's ends), strings (empty, unicode, NUL inside and at the end, long),
duplicates, empty batches, in lists and numpy arrays; bad ones: None, ints mixed with strings, a reserved
integer, a lone surrogate, floats. Vectors: float32/float64 arrays or nested lists; bad ones: another width
or row count, NaN, infinity, beyond float32, flat. A valid call must succeed and a bad one must raise
CacheError (a GenrecError and a ValueError), never anything else; a refused put writes nothing. After
every put, reads return exactly the last vectors written for each ID (a dict is the model).
"""

import uuid

import numpy as np
import pytest

from genrec.cache import EmbeddingTable, RedisStore, SQLiteStore
from genrec.cache.keys import EMPTY
from genrec.cache.policies import POLICIES
from genrec.errors import CacheError

DIM = 4
ROUNDS = 120


def id_pools(rng) -> dict[str, list]:
    ints = [0, 1, -1, 7, 10**15, -(10**15), int(np.iinfo(np.int64).max), int(EMPTY) + 2]
    ints += rng.integers(-(2**62), 2**62, size=12).tolist()
    strings = ["", " ", "1", "a", "ab", "ab\x00", "\x00", "a\x00b", "é", "😀", "user-1", "x" * 10_000]
    alphabet = list("ab\x00é€😀 ") + [chr(c) for c in range(0x20, 0x7F)]
    strings += ["".join(rng.choice(alphabet, size=rng.integers(1, 30))) for _ in range(12)]
    return {"int": ints, "str": list(dict.fromkeys(strings))}


def random_ids(rng, pools) -> tuple[object, list, bool]:
    """(the ids argument, the IDs as Python values, valid?)."""
    kind = "int" if rng.random() < 0.5 else "str"
    pool = pools[kind]
    values = [pool[i] for i in rng.integers(0, len(pool), size=rng.integers(0, 12))]  # duplicates included
    valid = True
    if values and rng.random() < 0.25:
        valid = False
        bad = rng.choice(["none", "mixed", "reserved", "surrogate", "float"])
        spot = int(rng.integers(0, len(values)))
        if bad == "mixed":  # added, not replaced: a batch of one would become valid
            values.insert(spot, 5 if kind == "str" else "5")
        else:
            values[spot] = {"none": None, "reserved": int(EMPTY), "surrogate": "\ud800", "float": 1.5}[bad]
    form = rng.choice(["list", "numpy"])
    if form == "list":
        return values, values, valid
    if not valid:
        return np.array(values, dtype=object), values, valid
    if kind == "int":
        return np.array(values, dtype=np.int64), values, valid
    if any(v.endswith("\x00") for v in values):  # numpy's str dtype drops trailing NULs: an object array keeps them
        return np.array(values, dtype=object), values, valid
    return np.array(values, dtype=object if rng.random() < 0.5 else str), values, valid


def random_vectors(rng, rows: int) -> tuple[object, bool]:
    vectors = rng.normal(size=(rows, DIM))
    if rng.random() < 0.3:
        bad = rng.choice(["width", "rows", "nan", "inf", "huge", "flat"])
        if bad == "width":
            return rng.normal(size=(rows, DIM + rng.choice([-1, 1]))), False
        if bad == "rows":
            return rng.normal(size=(rows + 1 + int(rng.integers(0, 3)), DIM)), False
        if bad == "flat":
            return vectors.ravel() if rows != 0 else np.ones(DIM), False
        if rows == 0:
            return vectors, True  # nothing to spoil
        vectors[rng.integers(0, rows), rng.integers(0, DIM)] = {"nan": np.nan, "inf": -np.inf, "huge": 1e39}[bad]
        return vectors, False
    form = rng.choice(["float32", "float64", "lists"])
    return (vectors.tolist() if form == "lists" else vectors.astype(form)), True


class Target:
    """A table or a store behind one read/write interface; `exact`: every written ID must be found."""

    def __init__(self, name, thing, exact=True, capacity=None):
        self.name, self.thing, self.exact, self.capacity = name, thing, exact, capacity
        self.is_table = isinstance(thing, EmbeddingTable)

    def write(self, ids, vectors):
        return self.thing.put(ids, vectors) if self.is_table else self.thing.put_many(ids, vectors)

    def read(self, ids):
        return self.thing.get(ids) if self.is_table else self.thing.get_many(ids)


def run_model_check(target: Target, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    pools = id_pools(rng)
    model: dict = {}
    outcomes = {"put": 0, "get": 0, "refused": 0}

    def check_reads(values, just_written=()):
        if not values:
            got, found = target.read(values)
            assert got.shape == (0, DIM) and found.shape == (0,)
            return
        got, found = target.read(values)
        assert got.shape == (len(values), DIM) and got.dtype == np.float32 and found.shape == (len(values),)
        for i, value in enumerate(values):
            if found[i]:
                assert value in model and got[i].tobytes() == model[value].tobytes(), (target.name, value)
            else:
                assert not got[i].any()
                assert value not in model or not (target.exact or value in just_written), (target.name, value)

    for _ in range(ROUNDS):
        ids, values, ids_valid = random_ids(rng, pools)
        if rng.random() < 0.5:
            vectors, vectors_valid = random_vectors(rng, len(values))
            try:
                target.write(ids, vectors)
            except CacheError:
                assert not (ids_valid and vectors_valid), f"{target.name}: a valid put was refused"
                outcomes["refused"] += 1
                continue
            assert ids_valid and vectors_valid, f"{target.name}: a bad put was accepted"
            rows = np.asarray(vectors, dtype=np.float32).reshape(len(values), DIM)
            model.update(zip(values, rows, strict=True))  # duplicates: the last wins
            outcomes["put"] += 1
            fits = target.capacity is None or len(set(values)) <= target.capacity
            check_reads(values, just_written=set(values) if fits else ())
        else:
            try:
                check_reads(values)
            except CacheError:
                assert not ids_valid, f"{target.name}: a valid get was refused"
                outcomes["refused"] += 1
                continue
            assert ids_valid, f"{target.name}: a get of bad IDs was accepted"
            outcomes["get"] += 1
        for kind in (int, str):  # earlier writes still read back (or, with evictions, are honestly missing)
            known = [v for v in model if isinstance(v, kind)]
            check_reads([known[i] for i in rng.integers(0, len(known), size=min(len(known), 8))] if known else [])
    return outcomes


def _tables(tmp_path):
    for policy in sorted(POLICIES):
        for admit_after in (1, 3):
            tag = f"{policy}-admit{admit_after}"
            yield Target(f"table-{tag}", EmbeddingTable(DIM, 1000, policy, admit_after))
            # Evicting all the time: without a store an evicted ID is honestly missing, with one it reads through.
            yield Target(f"small-{tag}", EmbeddingTable(DIM, 6, policy, admit_after), exact=False, capacity=6)
            store = SQLiteStore(tmp_path / f"{tag}.sqlite", DIM)
            yield Target(f"small-{tag}-sqlite", EmbeddingTable(DIM, 6, policy, admit_after, store=store))


def test_random_batches_against_every_table_configuration(tmp_path):
    totals = {"put": 0, "get": 0, "refused": 0}
    for seed, target in enumerate(_tables(tmp_path)):
        for key, count in run_model_check(target, seed).items():
            totals[key] += count
    assert min(totals.values()) > 100  # every branch ran many times


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("redis", marks=pytest.mark.integration)])
def test_random_batches_against_the_stores(tmp_path, request, kind):
    if kind == "sqlite":
        store = SQLiteStore(tmp_path / "random.sqlite", DIM)
    else:
        store = RedisStore(request.getfixturevalue("redis_url"), DIM, prefix=f"random:{uuid.uuid4().hex}:")
    outcomes = run_model_check(Target(kind, store), seed=100)
    store.close()
    assert min(outcomes.values()) > 5
