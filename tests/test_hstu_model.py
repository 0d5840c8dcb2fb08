"""The HSTU ranker against the plain float64 reference, and the properties the engine relies on: cached
prefix + appended events = cold forward, candidates independent of each other, batching never changes rows."""

from __future__ import annotations

import json
import random

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from genrec.errors import ModelDirectoryError
from genrec.model import hstu
from genrec.model.config import HSTUConfig
from genrec.model.directory import ModelDir
from genrec.model.hstu import HSTU, HistoryRows, HistorySegment
from genrec.model.kv_pool import KVPool
from genrec.testing.tiny import HSTUSpec, random_hstu, write_hstu_dir
from tests.hstu_reference import ranking_mask, reference_rank

TOL = 1e-5  # float32 model vs float64 reference
SAME = dict(atol=1e-6, rtol=1e-6)  # float32 vs float32: equal up to rounding


def make_config(**overrides) -> HSTUConfig:
    fields = dict(
        num_items=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=8,
        attention_normalizer=16.0,
        max_positions=64,
        num_actions=3,
        tasks=("click", "like"),
        head_hidden=16,
        num_time_buckets=5,
    )
    fields.update(overrides)
    return HSTUConfig(**fields)


def random_events(config: HSTUConfig, n: int, rng: random.Random, with_actions=True, with_buckets=True):
    items = [rng.randrange(config.num_items) for _ in range(n)]
    actions = [rng.choice([None, *range(config.num_actions)]) if with_actions else None for _ in range(n)]
    buckets = None
    if config.num_time_buckets and with_buckets:
        buckets = [rng.choice([None, *range(config.num_time_buckets)]) for _ in range(n)]
    return items, actions, buckets


def indices(values, none_index: int) -> torch.Tensor:
    return torch.tensor([none_index if v is None else v for v in values], dtype=torch.long)


def embed(model: HSTU, items, actions, positions, buckets) -> torch.Tensor:
    c = model.config
    return model.embed_events(
        torch.tensor(items, dtype=torch.long),
        None if actions is None else indices(actions, c.no_action),
        torch.tensor(positions, dtype=torch.long),
        None if buckets is None else indices(buckets, c.unknown_bucket),
    )


def empty_cache(config: HSTUConfig, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (config.num_hidden_layers, tokens, config.num_attention_heads, config.head_dim)
    return torch.full(shape, float("nan")), torch.full(shape, float("nan"))  # NaN: reading unwritten K/V shows


def prefill(model: HSTU, items, actions, buckets, chunks=None, capacity=None):
    """History in appended chunks (default: one). Returns (hidden [T, hidden], k, v)."""
    T = len(items)
    k, v = empty_cache(model.config, capacity or max(T, 1))
    bounds = [0, *(chunks or []), T]
    hidden = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        part_buckets = None if buckets is None else buckets[a:b]
        embeds = embed(model, items[a:b], actions[a:b], list(range(a, b)), part_buckets)
        hidden.append(model.prefill(embeds, k, v, start=a))
    return torch.cat(hidden), k[:, :T], v[:, :T]


def candidates(model: HSTU, T: int, cands, k, v, cand_buckets=None):
    """Hidden [C, hidden] and probs [C, tasks] of candidates after a history of T events."""
    embeds = embed(model, cands, None, [T] * len(cands), cand_buckets)
    hidden = model.forward_candidates(embeds, [HistoryRows(0, len(cands), k, v)])
    return hidden, model.task_probs(hidden)


@pytest.mark.parametrize(
    "seed, sizes, with_actions, with_buckets",
    [
        (0, {}, True, True),
        (1, {}, False, True),
        (2, {"num_time_buckets": 0}, True, False),
        (3, {"num_time_buckets": 0, "num_attention_heads": 3, "head_dim": 4}, False, False),
        (4, {"num_hidden_layers": 3, "hidden_size": 24, "head_hidden": 8, "tasks": ("a",)}, True, True),
        (5, {"num_actions": 0, "attention_normalizer": 3.0}, False, True),
    ],
)
def test_matches_the_float64_reference(seed, sizes, with_actions, with_buckets):
    config = make_config(**sizes)
    model = random_hstu(config, seed)
    rng = random.Random(seed)
    items, actions, buckets = random_events(config, 17, rng, with_actions, with_buckets)
    cands = [rng.randrange(config.num_items) for _ in range(6)]
    cand_buckets = [rng.randrange(config.num_time_buckets) for _ in cands] if buckets else None
    hist_hidden, k, v = prefill(model, items, actions, buckets)
    cand_hidden, probs = candidates(model, len(items), cands, k, v, cand_buckets)
    ref = reference_rank(model.state_dict(), config, items, actions, cands, buckets, cand_buckets)
    assert hist_hidden.dtype == torch.float32
    torch.testing.assert_close(hist_hidden.double(), ref.hidden[: len(items)], atol=TOL, rtol=0)
    torch.testing.assert_close(cand_hidden.double(), ref.hidden[len(items) :], atol=TOL, rtol=0)
    torch.testing.assert_close(probs.double(), ref.probs, atol=TOL, rtol=0)
    assert probs.std() > 0.05  # the weights give spread probabilities, so the comparison says something


def test_empty_history_candidates_see_only_themselves():
    config = make_config()
    model = random_hstu(config, 7)
    k, v = empty_cache(config, 4)
    _, probs = candidates(model, 0, [1, 2, 3], k[:, :0], v[:, :0])
    ref = reference_rank(model.state_dict(), config, [], [], [1, 2, 3])
    torch.testing.assert_close(probs.double(), ref.probs, atol=TOL, rtol=0)


def test_cached_prefix_plus_new_events_equals_a_cold_forward():
    config = make_config()
    model = random_hstu(config, 11)
    items, actions, buckets = random_events(config, 24, random.Random(11))
    cold_hidden, cold_k, cold_v = prefill(model, items, actions, buckets)
    warm_hidden, warm_k, warm_v = prefill(model, items, actions, buckets, chunks=[5, 6, 13, 20, 23])
    torch.testing.assert_close(warm_hidden, cold_hidden, **SAME)
    torch.testing.assert_close(warm_k, cold_k, **SAME)
    torch.testing.assert_close(warm_v, cold_v, **SAME)
    cands = [3, 9, 27]
    torch.testing.assert_close(
        candidates(model, 24, cands, warm_k, warm_v)[1], candidates(model, 24, cands, cold_k, cold_v)[1], **SAME
    )


def test_query_chunks_change_nothing(monkeypatch):
    config = make_config()
    model = random_hstu(config, 17)
    items, actions, buckets = random_events(config, 23, random.Random(17))
    whole = prefill(model, items, actions, buckets, chunks=[6])
    monkeypatch.setattr(hstu, "PREFILL_QUERY_CHUNK", 4)
    for got, want in zip(prefill(model, items, actions, buckets, chunks=[6]), whole, strict=True):
        torch.testing.assert_close(got, want, **SAME)


def test_prefill_writes_into_a_kv_pool_extent():
    """HSTUConfig drives genrec's KVPool unchanged; prefill into a pool slice equals a private cache."""
    config = make_config()
    model = random_hstu(config, 12)
    pool = KVPool(config, 40, "cpu", torch.float32)
    assert pool.k.shape == (2, 41, 2, 8) and pool.scratch == 40  # 40 to give out, then the scratch slot
    extent = pool.reserve(20)
    pool.reserve(20).k().fill_(float("nan"))  # a neighbour's garbage must never leak in
    items, actions, buckets = random_events(config, 15, random.Random(12))
    model.prefill(embed(model, items[:9], actions[:9], list(range(9)), buckets[:9]), extent.k(), extent.v(), 0)
    model.prefill(embed(model, items[9:], actions[9:], list(range(9, 15)), buckets[9:]), extent.k(), extent.v(), 9)
    _, k, v = prefill(model, items, actions, buckets)
    torch.testing.assert_close(extent.k()[:, :15], k, **SAME)
    torch.testing.assert_close(extent.v()[:, :15], v, **SAME)


def test_prefill_refuses_events_past_the_cache():
    config = make_config()
    model = random_hstu(config, 0)
    k, v = empty_cache(config, 4)
    with pytest.raises(ValueError, match="do not fit"):
        model.prefill(embed(model, [1, 2], None, [3, 4], None), k, v, start=3)


def test_a_candidate_does_not_depend_on_the_other_candidates():
    config = make_config()
    model = random_hstu(config, 13)
    items, actions, buckets = random_events(config, 12, random.Random(13))
    _, k, v = prefill(model, items, actions, buckets)
    base = [4, 8, 15, 16, 23, 42]
    _, probs = candidates(model, 12, base, k, v)
    by_item = dict(zip(base, probs, strict=True))
    for variant in ([42, 23, 16, 15, 8, 4], [8, 42], [15], [*base, 1, 2, 3, 4]):
        _, other = candidates(model, 12, variant, k, v)
        for item, row in zip(variant, other, strict=True):
            if item in by_item:
                torch.testing.assert_close(row, by_item[item], **SAME)
    assert torch.equal(probs[0], probs[0]) and not torch.allclose(probs[0], probs[1])  # items differ, so do rows


def test_several_requests_in_one_call_equal_each_alone():
    config = make_config()
    model = random_hstu(config, 14)
    rng = random.Random(14)
    requests = []
    for T, C in ((9, 4), (0, 2), (20, 5), (3, 1)):
        items, actions, buckets = random_events(config, T, rng)
        _, k, v = prefill(model, items, actions, buckets)
        cands = [rng.randrange(config.num_items) for _ in range(C)]
        requests.append((T, cands, k, v, candidates(model, T, cands, k, v)[1]))
    embeds, groups, row = [], [], 0
    for T, cands, k, v, _ in requests:
        embeds.append(embed(model, cands, None, [T] * len(cands), None))
        groups.append(HistoryRows(row, row + len(cands), k, v))
        row += len(cands)
    pad = embed(model, [0, 0], None, [0, 0], None)  # padding rows in no group: attend to themselves only
    hidden = model.forward_candidates(torch.cat([*embeds, pad]), groups)
    probs = model.task_probs(hidden)
    for (_, _, _, _, alone), g in zip(requests, groups, strict=True):
        torch.testing.assert_close(probs[g.start : g.stop], alone, **SAME)


def test_packed_prefill_equals_each_user_alone():
    config = make_config()
    model = random_hstu(config, 15)
    rng = random.Random(15)
    users = [random_events(config, n, rng) for n in (7, 1, 12)]
    alone = [prefill(model, *u) for u in users]
    segments, caches = [], []
    for items, actions, buckets in users:
        cache = empty_cache(config, len(items) + 3)
        caches.append(cache)
        embeds = embed(model, items, actions, list(range(len(items))), buckets)
        segments.append(HistorySegment(embeds, cache[0], cache[1], 0))
    packed = model.prefill_packed(segments)
    torch.testing.assert_close(packed, torch.cat([h for h, _, _ in alone]), **SAME)
    for (items, _, _), (_, k, v), (pk, pv) in zip(users, alone, caches, strict=True):
        torch.testing.assert_close(pk[:, : len(items)], k, **SAME)
        torch.testing.assert_close(pv[:, : len(items)], v, **SAME)


def test_the_mask_matters():
    config = make_config()
    model = random_hstu(config, 16)
    items, actions, buckets = random_events(config, 10, random.Random(16))
    hidden, k, v = prefill(model, items, actions, buckets)
    changed = [*items[:-1], (items[-1] + 1) % config.num_items]
    hidden2, k2, v2 = prefill(model, changed, actions, buckets)
    torch.testing.assert_close(hidden2[:-1], hidden[:-1], atol=0, rtol=0)  # earlier events never see later ones
    assert not torch.allclose(hidden2[-1], hidden[-1])
    _, probs = candidates(model, 10, [5], k, v)
    _, probs2 = candidates(model, 10, [5], k2, v2)
    assert (probs - probs2).abs().max() > 1e-4  # a candidate reads the history
    # The reference's mask is the target-aware one: history rows equal a run with no candidates at all. Equal to
    # float64 rounding, not bit for bit: the two runs' matrix products have different shapes, and BLAS may sum
    # them in another order (it does on some CPUs); a candidate that leaked into the history would move it ~1e-2.
    ref = reference_rank(model.state_dict(), config, items, actions, [5, 6], buckets)
    ref_alone = reference_rank(model.state_dict(), config, items, actions, [], buckets)
    torch.testing.assert_close(ref.hidden[:10], ref_alone.hidden, atol=1e-12, rtol=0)
    mask = ranking_mask(2, 2)
    assert mask.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]


def test_model_directory_round_trip(tmp_path):
    spec = HSTUSpec(items=40, hidden=32, layers=2, heads=2, head_dim=8, max_positions=64, head_hidden=16, seed=3)
    out = write_hstu_dir(tmp_path / "hstu", spec)
    body = json.loads((out / "config.json").read_text())
    assert body["model_type"] == "genrec_hstu" and body["tasks"] == list(spec.tasks)
    assert HSTUConfig.from_dict(body) == spec.config()
    catalog = pq.read_table(out / "genrec" / "catalog.parquet")
    assert catalog.column("item_id").to_pylist()[:2] == ["item-000000", "item-000001"]
    assert catalog.column("item_index").to_pylist() == list(range(40))
    assert str(catalog.schema.field("item_id").type) == "string"

    loaded = ModelDir.open(out).load_model()
    original = random_hstu(spec.config(), spec.seed)
    items, actions, buckets = random_events(loaded.config, 8, random.Random(3))
    for model in (loaded, original):
        _, k, v = prefill(model, items, actions, buckets)
        model.result = candidates(model, 8, [1, 2, 3], k, v)[1]
    assert torch.equal(loaded.result, original.result)
    assert set(load_file(str(out / "model.safetensors"))) == set(dict(original.named_parameters()))


def test_save_load_keeps_outputs_identical(tmp_path):
    config = make_config(num_time_buckets=0)
    model = random_hstu(config, 21)
    loaded = ModelDir.open(model.save(tmp_path / "m")).load_model()
    for name, p in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p)
    embeds = embed(model, [1, 2], [0, None], [0, 0], None)
    assert torch.equal(model.forward_candidates(embeds, []), loaded.forward_candidates(embeds, []))


def test_load_refuses_weights_that_do_not_fit_the_config(tmp_path):
    config = make_config()
    out = random_hstu(config, 0).save(tmp_path / "m")
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["bucket_embedding.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ModelDirectoryError, match="lack 1 tensors"):
        ModelDir.open(out).load_model()
    body = json.loads((out / "config.json").read_text())
    body["num_time_buckets"] = 0
    body["hidden_size"] = 30
    (out / "config.json").write_text(json.dumps(body))
    with pytest.raises(ModelDirectoryError, match="shape"):
        ModelDir.open(out).load_model()


def test_config_round_trip_and_validation():
    config = make_config()
    assert HSTUConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert config.num_key_value_heads == config.num_attention_heads == 2
    assert (config.no_action, config.unknown_bucket, config.max_history_events) == (3, 5, 63)
    with pytest.raises(ModelDirectoryError, match="model_type"):
        HSTUConfig.from_dict({**config.to_dict(), "model_type": "qwen3"})
    with pytest.raises(ModelDirectoryError, match="lacks tasks"):
        HSTUConfig.from_dict({k: v for k, v in config.to_dict().items() if k != "tasks"})
    with pytest.raises(ModelDirectoryError, match="attention_normalizer"):
        HSTUConfig.from_dict({**config.to_dict(), "attention_normalizer": 0})
    with pytest.raises(ModelDirectoryError, match="distinct"):
        HSTUConfig.from_dict({**config.to_dict(), "tasks": ["a", "a"]})
    with pytest.raises(ValueError, match="max_positions"):
        make_config(max_positions=1)


def test_time_buckets_are_log2_gaps_fixed_per_event():
    config = make_config(num_time_buckets=5)
    assert config.time_buckets([100.0, 100.0, 101.0, 104.0, None, 200.0, 10**9]) == [5, 0, 1, 2, 5, 5, 4]
    # Appending: the first new event's gap is to the last cached event, so buckets never depend on the split.
    whole = config.time_buckets([10.0, 13.0, 20.0, 19.0])
    assert whole[:2] + config.time_buckets([20.0, 19.0], previous=13.0) == whole
    assert whole[-1] == 0  # clock skew: a negative gap counts as zero


def test_buckets_on_a_model_without_them_are_refused():
    model = random_hstu(make_config(num_time_buckets=0), 0)
    with pytest.raises(ValueError, match="num_time_buckets"):
        embed(model, [1], None, [0], [0])
