"""Per-request filters inside the constrained decode: only allowed items ever take a beam (full-width beams equal
the exhaustive ranking of the allowed items), the filter forms, refusals naming the field, the mask cache, score,
recommend and the batch job's per-row filters."""

import json
import shutil
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from genrec.api import Candidate, FilterRange, RecommendRequest, RetrieveRequest, ScoreRequest
from genrec.catalog import Catalog
from genrec.catalog.filters import Attributes, allowed_items
from genrec.engine import Engine, SchedulerConfig
from genrec.engine.scheduler import Scheduler
from genrec.engine.served_catalog import FilterMasks
from genrec.errors import InvalidRequestError
from tests.conftest import random_prompt
from tests.reference import hf_constrained_beams
from tests.sync_guard import no_sync
from tests.test_retrieve import TOL, exhaustive_ranking

GENRES = ("comedy", "drama", "news", "sport", "music")
DAY = 86400


def attributes(n: int) -> pa.Table:
    """Item i: genre GENRES[i % 5]; markets a list (us when i is even, de when i % 3 == 0, possibly empty; null
    for every 7th); year 1990 + i % 40; an availability window with null (open) bounds on some items."""
    start = datetime(2026, 1, 1, tzinfo=UTC).timestamp()
    markets = [None if i % 7 == 6 else ["us"] * (i % 2 == 0) + ["de"] * (i % 3 == 0) for i in range(n)]
    return pa.table(
        {
            "genre": pa.array([GENRES[i % 5] for i in range(n)]),
            "markets": pa.array(markets, pa.list_(pa.string())),
            "year": pa.array([1990 + i % 40 for i in range(n)], pa.int64()),
            "available_from": pa.array(
                [None if i % 4 == 0 else int(start + (i % 10) * DAY) for i in range(n)], pa.timestamp("s", tz="UTC")
            ),
            "available_until": pa.array(
                [None if i % 5 == 0 else int(start + (10 + i % 20) * DAY) * 1000 for i in range(n)], pa.timestamp("ms")
            ),
        }
    )


@pytest.fixture(scope="module")
def attr_dir(tiny_dir, tmp_path_factory):
    """The session's tiny model (same weights, same codes) whose catalog also has attribute columns."""
    out = tmp_path_factory.mktemp("filters") / "model"
    shutil.copytree(tiny_dir, out)
    path = out / "genrec" / "catalog.parquet"
    table = pq.read_table(path)
    for name, column in zip(attributes(table.num_rows).column_names, attributes(table.num_rows).columns, strict=True):
        table = table.append_column(name, column)
    pq.write_table(table, path)
    return out


@pytest.fixture(scope="module")
def fengine(attr_dir):
    return Engine.from_pretrained(attr_dir, scheduler=SchedulerConfig(prefix_cache_bytes=0))


def mask_of(engine, **fields) -> np.ndarray:
    request = RetrieveRequest(prompt="x", **fields)
    return allowed_items(Attributes(engine.catalog), request.filters, request.allowed_item_ids)


def ids(engine, mask) -> set[str]:
    return set(engine.catalog.item_ids[np.flatnonzero(mask)].tolist())


# -- the forms ---------------------------------------------------------------------------------------------------


def test_each_form_allows_exactly_the_items_it_says(fengine):
    n = len(fengine.catalog)
    rows = range(n)
    markets = [None if i % 7 == 6 else ["us"] * (i % 2 == 0) + ["de"] * (i % 3 == 0) for i in rows]
    cases = [
        ({"genre": "drama"}, [i % 5 == 1 for i in rows]),
        ({"genre": ["drama", "news"]}, [i % 5 in (1, 2) for i in rows]),
        ({"markets": "de"}, [m is not None and "de" in m for m in markets]),  # a list attribute: contains
        ({"markets": ["us", "de"]}, [bool(m) for m in markets]),  # any of; empty and null lists never
        ({"year": {"gte": 2000, "lt": 2010}}, [2000 <= 1990 + i % 40 < 2010 for i in rows]),
        ({"year": 1995}, [1990 + i % 40 == 1995 for i in rows]),
        ({"year": {"gt": 2010.5}}, [1990 + i % 40 > 2010.5 for i in rows]),
        ({"genre": "drama", "year": {"lte": 2000}}, [i % 5 == 1 and 1990 + i % 40 <= 2000 for i in rows]),
    ]
    for filters, want in cases:
        assert mask_of(fengine, filters=filters).tolist() == want, filters


def test_the_availability_window_has_open_null_bounds(fengine):
    n = len(fengine.catalog)
    for day in (-1, 0, 5, 9.5, 15, 29, 40):
        t = datetime(2026, 1, 1, tzinfo=UTC).timestamp() + day * DAY
        at = datetime.fromtimestamp(t, UTC).isoformat()
        got = mask_of(fengine, filters={"available_at": at})
        start = [None if i % 4 == 0 else i % 10 for i in range(n)]
        until = [None if i % 5 == 0 else 10 + i % 20 for i in range(n)]
        want = [(s is None or s <= day) and (u is None or day < u) for s, u in zip(start, until, strict=True)]
        assert got.tolist() == want, day
    # A time without a zone is UTC; a timestamp range works on either bound's column.
    assert (
        mask_of(fengine, filters={"available_at": "2026-01-06T00:00:00"}).tolist()
        == mask_of(fengine, filters={"available_at": "2026-01-06T01:00:00+01:00"}).tolist()
    )
    late = mask_of(fengine, filters={"available_from": {"gte": "2026-01-09T00:00:00Z"}})
    assert late.tolist() == [i % 4 != 0 and i % 10 >= 8 for i in range(n)]


def test_allowed_item_ids_and_filters_and_exclusions_all_and_together(fengine, hf_model, rng):
    catalog = fengine.catalog
    allowed = [catalog.item_ids[i] for i in range(0, len(catalog), 2)]  # even rows
    excluded = [catalog.item_ids[i] for i in range(0, 40)]
    filters = {"genre": ["comedy", "news"]}  # i % 5 in (0, 2)
    prompt = random_prompt(fengine, 12, rng)
    request = RetrieveRequest(
        prompt_token_ids=prompt,
        beam_width=len(catalog),
        filters=filters,
        allowed_item_ids=allowed,
        exclude_item_ids=excluded,
    )
    (result,) = fengine.retrieve([request])
    keep = [i for i in range(len(catalog)) if i % 2 == 0 and i % 5 in (0, 2) and i >= 40]
    want = exhaustive_ranking(fengine, hf_model, prompt, keep)
    assert [i.item_id for i in result.items] == [item for item, _ in want]
    assert max(abs(i.logprob - s) for i, (_, s) in zip(result.items, want, strict=True)) <= TOL


# -- the decode ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "filters", [{"genre": "sport"}, {"markets": "de", "year": {"lt": 2015}}, {"available_at": "2026-01-12T00:00:00Z"}]
)
def test_full_width_filtered_retrieve_is_the_exhaustive_ranking_of_the_allowed_items(fengine, hf_model, rng, filters):
    prompt = random_prompt(fengine, 30, rng)
    (result,) = fengine.retrieve(
        [RetrieveRequest(prompt_token_ids=prompt, beam_width=len(fengine.catalog), filters=filters)]
    )
    keep = np.flatnonzero(mask_of(fengine, filters=filters))
    assert 0 < len(keep) < len(fengine.catalog)
    want = exhaustive_ranking(fengine, hf_model, prompt, keep)
    assert [i.item_id for i in result.items] == [item for item, _ in want]
    assert max(abs(i.logprob - s) for i, (_, s) in zip(result.items, want, strict=True)) <= TOL


@pytest.mark.parametrize("beam_width", [1, 4])
def test_narrow_filtered_beams_are_a_beam_search_over_the_allowed_items_only(fengine, hf_model, rng, beam_width):
    """Not filtered after the search: the beams are transformers' beam search over the allowed catalog."""
    prompt = random_prompt(fengine, 25, rng)
    filters = {"genre": "news", "year": {"gte": 2000}}
    (result,) = fengine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=beam_width, filters=filters)])
    keep = np.flatnonzero(mask_of(fengine, filters=filters))
    assert {i.item_id for i in result.items} <= ids(fengine, mask_of(fengine, filters=filters))
    codes, scores = hf_constrained_beams(
        hf_model, prompt, fengine.catalog.codes[keep], beam_width, fengine.family.tokenizer.pad_token_id
    )
    assert len(result.items) == beam_width
    assert [i.semantic_id for i in result.items] == codes
    assert np.allclose([i.logprob for i in result.items], scores, atol=TOL)
    (plain,) = fengine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=beam_width)])
    assert [i.item_id for i in plain.items] != [i.item_id for i in result.items]  # the filter changed the beams


def test_filtered_and_unfiltered_requests_in_one_batch_equal_each_alone(fengine, rng):
    requests = [
        RetrieveRequest(prompt_token_ids=random_prompt(fengine, 9, rng), beam_width=6, filters={"genre": "drama"}),
        RetrieveRequest(prompt_token_ids=random_prompt(fengine, 14, rng), beam_width=5),
        RetrieveRequest(
            prompt_token_ids=random_prompt(fengine, 11, rng), beam_width=3, allowed_item_ids=["item-000007"]
        ),
    ]
    together = fengine.retrieve(requests)
    for request, result in zip(requests, together, strict=True):
        (alone,) = fengine.retrieve([request])
        assert [i.item_id for i in result.items] == [i.item_id for i in alone.items]
    assert [i.item_id for i in together[2].items] == ["item-000007"]
    assert {i.item_id for i in together[0].items} <= ids(fengine, mask_of(fengine, filters={"genre": "drama"}))


def test_a_filter_that_allows_nothing_returns_no_items(fengine, rng):
    prompt = random_prompt(fengine, 10, rng)
    nothing = {"genre": "comedy", "year": {"gt": 3000}}
    (retrieved,) = fengine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=8, filters=nothing)])
    (empty_list,) = fengine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=8, allowed_item_ids=[])])
    (recommended,) = fengine.recommend(
        [
            RecommendRequest(
                prompt_token_ids=prompt, beam_width=8, filters=nothing, candidates=[Candidate(item_id="item-000001")]
            )
        ]
    )
    (scored,) = fengine.score(
        [ScoreRequest(prompt_token_ids=prompt, filters=nothing, candidates=[Candidate(item_id="item-000001")])]
    )
    assert retrieved.items == empty_list.items == recommended.items == scored.scores == []
    assert scored.filtered_out == 1


# -- refusals ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"filters": {"colour": "red"}}, "filters.colour"),
        ({"filters": {"genre": "comedyy"}}, "filters.genre"),
        ({"filters": {"markets": ["us", "fr"]}}, "filters.markets[1]"),
        ({"filters": {"genre": 3}}, "filters.genre"),
        ({"filters": {"year": "1999"}}, "filters.year"),
        ({"filters": {"year": {"gte": 1990, "lt": "x"}}}, "filters.year.lt"),
        ({"filters": {"genre": {"gte": "a"}}}, "filters.genre.gte"),
        ({"filters": {"available_at": "yesterday"}}, "filters.available_at"),
        ({"filters": {"available_at": 5}}, "filters.available_at"),
        ({"allowed_item_ids": ["item-000001", "item-999999"]}, "allowed_item_ids[1]"),
    ],
)
def test_unknown_attributes_values_and_items_are_refused_naming_the_field(fengine, fields, field):
    with pytest.raises(InvalidRequestError) as err:
        fengine.retrieve([RetrieveRequest(prompt="a user", beam_width=2, **fields)])
    assert err.value.field == field


def test_a_catalog_without_the_window_refuses_available_at(engine):
    """The session's catalog has no attribute columns at all."""
    with pytest.raises(InvalidRequestError) as err:
        engine.retrieve([RetrieveRequest(prompt="a", filters={"available_at": "2026-01-01T00:00:00Z"})])
    assert err.value.field == "filters.available_at" and "available_from" in err.value.problem
    with pytest.raises(InvalidRequestError) as err:
        engine.retrieve([RetrieveRequest(prompt="a", filters={"genre": "comedy"})])
    assert err.value.field == "filters.genre"


# -- the mask cache ------------------------------------------------------------------------------------------------


def test_masks_are_cached_per_filter_and_bounded_in_bytes_least_recently_used_first(fengine):
    served = fengine.family.catalogs.current
    one = RetrieveRequest(prompt="a", filters={"genre": "drama"})
    size = served.filters.get(one).nbytes
    masks = FilterMasks(served.catalog, served.trie, max_bytes=2 * size)
    first = masks.get(one)
    again = masks.get(RetrieveRequest(prompt="b", filters={"genre": "drama"}))
    assert again is first and (masks.hits, masks.misses) == (1, 1)
    masks.get(RetrieveRequest(prompt="a", filters={"genre": "news"}))
    masks.get(one)  # drama is now the most recently used
    masks.get(RetrieveRequest(prompt="a", filters={"genre": "sport"}))  # evicts news, not drama
    assert len(masks) == 2 and masks.nbytes == 2 * size <= masks.max_bytes
    assert masks.get(one) is first
    misses = masks.misses
    masks.get(RetrieveRequest(prompt="a", filters={"genre": "news"}))
    assert masks.misses == misses + 1
    assert masks.get(RetrieveRequest(prompt="a")) is None  # no filter: nothing compiled
    tiny = FilterMasks(served.catalog, served.trie, max_bytes=size - 1)
    assert tiny.get(one).allowed == first.allowed and len(tiny) == 0 == tiny.nbytes  # too large to keep


def test_a_repeated_filter_hits_the_served_catalogs_cache(fengine, rng):
    cache = fengine.family.catalogs.current.filters
    request = RetrieveRequest(prompt_token_ids=random_prompt(fengine, 8, rng), beam_width=3, filters={"year": 2001})
    fengine.retrieve([request])
    hits = cache.hits
    fengine.retrieve([request.model_copy(update={"filters": {"year": 2001}})])
    assert cache.hits == hits + 1


# -- score, recommend, no sync -----------------------------------------------------------------------------------


def test_score_leaves_out_and_counts_the_candidates_a_filter_does_not_allow(fengine, rng):
    prompt = random_prompt(fengine, 15, rng)
    given = [f"item-{i:06d}" for i in (1, 2, 6, 11, 12)]  # genres drama, news, drama, drama, news
    candidates = [Candidate(item_id=i) for i in given]
    (plain,) = fengine.score([ScoreRequest(prompt_token_ids=prompt, candidates=candidates)])
    (filtered,) = fengine.score(
        [ScoreRequest(prompt_token_ids=prompt, candidates=candidates, filters={"genre": "drama"})]
    )
    assert [s.item_id for s in filtered.scores] == ["item-000001", "item-000006", "item-000011"]
    assert filtered.filtered_out == 2 and plain.filtered_out == 0
    by_id = {s.item_id: s.logprob for s in plain.scores}
    assert all(abs(s.logprob - by_id[s.item_id]) < 1e-5 for s in filtered.scores)
    with pytest.raises(InvalidRequestError) as err:
        fengine.score([ScoreRequest(prompt="a", candidates=[*candidates, Candidate(text="x")], filters={})])
    assert err.value.field == "candidates[5]"


def test_recommend_drops_given_candidates_the_filter_does_not_allow(fengine, rng):
    filters = {"genre": "drama"}
    allowed = ids(fengine, mask_of(fengine, filters=filters))
    request = RecommendRequest(
        prompt_token_ids=random_prompt(fengine, 15, rng),
        beam_width=5,
        filters=filters,
        candidates=[Candidate(item_id="item-000001"), Candidate(item_id="item-000002")],  # drama, news
    )
    (result,) = fengine.recommend([request])
    assert {i.item_id for i in result.items} <= allowed
    assert "item-000001" in {i.item_id for i in result.items} and len(result.items) >= 5


def test_filtered_steps_run_without_a_sync(fengine, rng):
    scheduler = Scheduler(fengine.family, fengine.runner, SchedulerConfig(prefill_tokens_per_step=16))
    batch = [
        RetrieveRequest(prompt_token_ids=random_prompt(fengine, 20, rng), beam_width=7, filters={"genre": "music"}),
        RetrieveRequest(prompt_token_ids=random_prompt(fengine, 20, rng), beam_width=4),
        RecommendRequest(
            prompt_token_ids=random_prompt(fengine, 20, rng),
            beam_width=5,
            allowed_item_ids=[f"item-{i:06d}" for i in range(50)],
            exclude_item_ids=["item-000003"],
        ),
    ]
    futures = [scheduler.submit(fengine.prepare(r)) for r in batch]
    with no_sync():
        while not scheduler.idle:
            scheduler.step()
    results = [f.result() for f in futures]
    assert all(r.items for r in results)
    assert {i.item_id for i in results[2].items} <= {f"item-{i:06d}" for i in range(50)} - {"item-000003"}


# -- the catalog and the batch job -------------------------------------------------------------------------------


def test_the_catalog_keeps_its_attribute_columns_through_load_and_save(attr_dir, tmp_path):
    catalog = Catalog.load(attr_dir / "genrec" / "catalog.parquet")
    assert catalog.attributes.column_names == ["genre", "markets", "year", "available_from", "available_until"]
    catalog.save(tmp_path / "again.parquet")
    again = Catalog.load(tmp_path / "again.parquet")
    assert again.attributes.equals(catalog.attributes)
    assert (again.item_ids == catalog.item_ids).all() and (again.codes == catalog.codes).all()


def test_the_batch_job_takes_filters_per_row_and_a_bad_row_fails_only_itself(attr_dir, tmp_path, rng, fengine):
    from genrec.batch import RecommendSpec
    from genrec.batch.stages import Retrieve
    from tests.shard_runs import error_rows, run_in_process

    prompts = [random_prompt(fengine, 10, rng) for _ in range(5)]
    filters = [json.dumps({"genre": "drama"}), None, json.dumps({"genre": "nope"}), "{not json", None]
    allowed = [None, None, None, None, ["item-000004", "item-000009"]]
    users = pa.table(
        {
            "user_id": [f"u{k}" for k in range(5)],
            "prompt_token_ids": pa.array(prompts, pa.list_(pa.int64())),
            "filters": pa.array(filters, pa.string()),
            "allowed_item_ids": pa.array(allowed, pa.list_(pa.string())),
        }
    )
    pq.write_table(users, tmp_path / "users.parquet")
    spec = RecommendSpec(
        model=str(attr_dir), users=str(tmp_path / "users.parquet"), out=str(tmp_path / "out"), beam_width=4
    )
    shard, _, report = run_in_process(Retrieve(spec))
    assert report["errors"] == 2
    assert error_rows(spec.out, shard) == [(2, "filters.genre", "u2"), (3, "filters", "u3")]
    rows = pq.read_table(tmp_path / "out" / "recommendations").to_pylist()
    by_user = {}
    for row in rows:
        by_user.setdefault(row["user_id"], []).append(row["item_id"])
    drama = ids(fengine, mask_of(fengine, filters={"genre": "drama"}))
    assert len(by_user["u0"]) == 4 and set(by_user["u0"]) <= drama
    assert len(by_user["u1"]) == 4
    assert sorted(by_user["u4"]) == ["item-000004", "item-000009"]


def test_null_attributes_meet_no_condition_and_dictionary_columns_read_as_text():
    table = pa.table(
        {
            "genre": pa.array(["a", None, "b", "a"]).dictionary_encode(),
            "markets": pa.array([["us", None], None, [], ["de"]], pa.list_(pa.string())),
            "score": pa.array([1.5, None, 3.0, 0.5]),
        }
    )
    catalog = Catalog.validated(
        np.array(["i0", "i1", "i2", "i3"], dtype=object), np.array([[1, 2], [1, 3], [2, 2], [2, 3]]), attributes=table
    )

    def allowed(filters):
        return allowed_items(Attributes(catalog), RetrieveRequest(prompt="x", filters=filters).filters, None).tolist()

    assert allowed({"genre": "a"}) == [True, False, False, True]
    assert allowed({"genre": ["a", "b"]}) == [True, False, True, True]
    assert allowed({"markets": ["us", "de"]}) == [True, False, False, True]
    assert allowed({"score": {"gt": 1}}) == [True, False, True, False]
    assert allowed({"score": {"lte": 1.5}, "genre": "a"}) == [True, False, False, True]


def test_a_subtree_whose_allowed_items_are_all_excluded_takes_no_beam(fengine, hf_model, rng):
    """The exclusions' dead nodes count a filtered request's allowed items only: excluding every allowed item under
    the best first token (its other items are not allowed anyway) frees that subtree's beams."""
    catalog, prompt = fengine.catalog, random_prompt(fengine, 20, rng)
    filters = {"genre": ["drama", "sport"]}
    allowed = mask_of(fengine, filters=filters)
    (first,) = fengine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=4, filters=filters)])
    top = first.items[0].semantic_id[0]
    excluded = [i for i in np.flatnonzero(allowed) if catalog.codes[i, 0] == top]
    request = RetrieveRequest(
        prompt_token_ids=prompt, beam_width=4, filters=filters, exclude_item_ids=catalog.item_ids[excluded].tolist()
    )
    (result,) = fengine.retrieve([request])
    keep = [i for i in np.flatnonzero(allowed) if catalog.codes[i, 0] != top]
    codes, scores = hf_constrained_beams(
        hf_model, prompt, catalog.codes[keep], 4, fengine.family.tokenizer.pad_token_id
    )
    assert len(result.items) == 4 and all(i.semantic_id[0] != top for i in result.items)
    assert [i.semantic_id for i in result.items] == codes
    assert np.allclose([i.logprob for i in result.items], scores, atol=TOL)


def test_a_struct_filters_column_leaves_out_its_null_fields():
    from genrec.batch.stages import row_filters

    fields = {"filters": {"genre": "drama", "year": None, "rank": {"gte": 3, "lt": None}}}
    assert row_filters(0, fields) is None
    assert RetrieveRequest(prompt="x", **fields).filters == {"genre": "drama", "rank": FilterRange(gte=3)}
    assert row_filters(4, {"filters": "[1, 2]"}).field == "filters"


def test_a_filtered_two_stage_recommend_is_two_calls_keeping_the_given_items_as_recommend_does(
    fengine, ranker, monkeypatch
):
    """Stage 1 is one call, the retriever's recommend in beam order: its filters, exclusions and allowed_item_ids
    keep the given items exactly as the single-stage recommend of the same request does (the decoder's one rule);
    stage 2, the ranker's rank of stage 1's items. No call asks the retriever which given items the filters allow."""
    from tests.funnel_ingress import two_stage

    catalog = fengine.catalog
    given = [catalog.item_ids[i] for i in (3, 1, 6, 1, 11, 16, 2, 21, 26)]  # drama: 1, 6, 11, 16, 21, 26
    request = {
        "prompt": "user listened to comedy podcast episode then news daily",
        "beam_width": 6,
        "filters": {"genre": "drama", "year": {"lt": 2015}},  # year 1990 + i % 40: 26 is 2016
        "exclude_item_ids": [catalog.item_ids[6]],
        "candidates": [{"item_id": g} for g in given],
    }
    status, answer, calls = two_stage(fengine, ranker, request | {"history": [{"item_id": "item-000001"}]}, monkeypatch)
    assert status == 200 and not answer["degraded"], answer
    assert [(c.deployment, c.method) for c in calls] == [("retriever", "recommend"), ("ranker", "rank")]
    stage1, stage2 = calls
    (single,) = fengine.recommend([RecommendRequest(**request)])
    kept = [(i.item_id, i.source) for i in stage1.result.items if i.source != "retrieved"]
    assert sorted(kept) == sorted((i.item_id, i.source) for i in single.items if i.source != "retrieved")
    assert {i for i, _ in kept} == {catalog.item_ids[k] for k in (1, 11, 16, 21)}  # not 6 (excluded) nor 26
    assert stage2.request.candidates == [i.item_id for i in stage1.result.items]
    assert stage1.request.filters == RecommendRequest(**request).filters and stage1.request.rank_by == "beam"
    assert not hasattr(fengine, "allowed_items")


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"candidates": [{"item_id": "item-000001"}, {"item_id": "not-in-the-catalog"}]}, "candidates[1].item_id"),
        ({"filters": {"colour": "red"}}, "filters.colour"),
    ],
)
def test_a_two_stage_recommends_stage1_refuses_what_recommend_refuses(fengine, ranker, monkeypatch, fields, field):
    """A given item the retriever's catalog does not hold, a filter on an attribute it lacks: the client's 422 from
    stage 1, as the single-stage recommend's, and the ranker is never called."""
    from tests.funnel_ingress import two_stage

    body = {"prompt": "user listened", "beam_width": 4, "history": [{"item_id": "item-000001"}], **fields}
    status, answer, calls = two_stage(fengine, ranker, body, monkeypatch)
    assert status == 422 and answer["details"][0]["field"] == field, answer
    assert [(c.deployment, c.method) for c in calls] == [("retriever", "recommend")]


def test_numbers_the_column_cannot_hold_are_refused_or_compared_exactly():
    """Never truncated (1991.5 is not 1991) and never a 5xx for a value beyond the column's type."""
    attributes = pa.table({"year": pa.array([1990, 1991, 1992, 2**20], pa.int32())})
    catalog = Catalog.validated(["a", "b", "c", "d"], np.array([[1], [2], [3], [4]]), attributes=attributes)
    table = Attributes(catalog)

    def allowed(filters):
        return allowed_items(table, RetrieveRequest(prompt="x", filters=filters).filters, None).tolist()

    assert allowed({"year": 1991.0}) == [False, True, False, False]
    assert allowed({"year": {"gte": 1991.5}}) == [False, False, True, True]
    assert allowed({"year": {"gte": 2**70}}) == [False] * 4 and allowed({"year": {"lte": 2**70}}) == [True] * 4
    for filters, field in (({"year": 1991.5}, "filters.year"), ({"year": [1990, 2**40]}, "filters.year")):
        with pytest.raises(InvalidRequestError, match=field):
            allowed(filters)
