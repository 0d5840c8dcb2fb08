"""Catalog versions served live: loaded and swapped without a restart, rolled back, refused when they do not
validate; a request keeps the version it was prepared with; the prefix cache holds across versions."""

import numpy as np
import pytest

from genrec.api import RetrieveRequest, ScoreRequest
from genrec.catalog.catalog import Catalog, catalog_version
from genrec.errors import CatalogError
from tests.conftest import random_prompt


@pytest.fixture
def fresh(tiny_dir):
    """An engine of its own (these tests change its catalog), its prefix cache on."""
    from genrec.engine import Engine, SchedulerConfig

    return Engine.from_pretrained(tiny_dir, scheduler=SchedulerConfig(prefix_cache_bytes=1 << 22))


def write_subset(catalog: Catalog, rows, path):
    rows = np.asarray(rows)
    Catalog(catalog.item_ids[rows], catalog.codes[rows], catalog.lengths[rows]).save(path)
    return path


def full_width(engine, prompt, **fields):
    (result,) = engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=len(engine.catalog), **fields)])
    return result


def test_a_loaded_catalog_serves_the_next_request_and_rolls_back(fresh, tiny_dir, tmp_path, rng):
    first = fresh.catalog
    prompt = random_prompt(fresh, 12, rng)
    before = full_width(fresh, prompt)
    assert before.catalog_version == catalog_version(tiny_dir / "genrec/catalog.parquet") == first.version

    kept = np.arange(0, len(first), 3)  # a third of the items stay
    path = write_subset(first, kept, tmp_path / "v2.parquet")
    state = fresh.load_catalog(path)
    assert state == {"catalog_version": catalog_version(path), "previous_catalog_version": first.version}
    after = full_width(fresh, prompt)
    assert after.catalog_version == catalog_version(path)
    assert {i.item_id for i in after.items} == set(first.item_ids[kept].tolist())
    # The kept items keep their scores: the model and the prompt's K/V did not change, only the allowed codes.
    scores = {i.item_id: i.logprob for i in before.items}
    assert max(abs(scores[i.item_id] - i.logprob) for i in after.items) < 1e-5

    state = fresh.rollback_catalog()
    assert state["catalog_version"] == first.version and state["previous_catalog_version"] == catalog_version(path)
    again = full_width(fresh, prompt)
    assert [i.item_id for i in again.items] == [i.item_id for i in before.items]


def test_loading_the_previous_version_again_is_a_swap_not_a_rebuild(fresh, tiny_dir, tmp_path):
    versions = fresh.family.catalogs
    original = versions.current
    path = write_subset(fresh.catalog, np.arange(0, len(fresh.catalog), 2), tmp_path / "half.parquet")
    fresh.load_catalog(path)
    fresh.load_catalog(tiny_dir / "genrec/catalog.parquet")
    assert versions.current is original  # the same built trie, swapped back


def test_a_request_keeps_the_version_it_was_prepared_with(fresh, tmp_path, rng):
    """Prepared before the swap and after it, both run in the same decode steps (two tries in one pass)."""
    first = fresh.catalog
    prompt = random_prompt(fresh, 9, rng)
    old = fresh.prepare(RetrieveRequest(prompt_token_ids=prompt, beam_width=len(first)))
    kept = np.arange(1, len(first), 4)
    path = write_subset(first, kept, tmp_path / "v2.parquet")
    fresh.load_catalog(path)
    new = fresh.prepare(RetrieveRequest(prompt_token_ids=prompt, beam_width=len(first)))
    (_, old_result), (_, new_result) = fresh._execute([(0, old), (1, new)])
    assert old_result.catalog_version == first.version and len(old_result.items) == len(first)
    assert new_result.catalog_version == catalog_version(path)
    assert {i.item_id for i in new_result.items} == set(first.item_ids[kept].tolist())


def test_a_catalog_that_does_not_validate_is_refused_and_the_running_one_stays(fresh, tmp_path):
    running = fresh.family.catalogs.current
    catalog = fresh.catalog
    outside = Catalog(catalog.item_ids[:3], np.full((3, catalog.levels), 5, dtype=np.int64))  # not SID tokens
    cases = {
        "missing.parquet": "missing",
        "outside.parquet": "semantic_id",
    }
    outside.save(tmp_path / "outside.parquet")
    for name, fragment in cases.items():
        with pytest.raises(CatalogError, match=fragment):
            fresh.load_catalog(tmp_path / name)
        assert fresh.family.catalogs.current is running


def test_a_catalog_of_longer_codes_than_the_engine_was_sized_for_is_refused(fresh, tmp_path):
    from genrec.engine.served_catalog import CatalogVersions

    versions = fresh.family.catalogs
    path = write_subset(fresh.catalog, np.arange(10), tmp_path / "v.parquet")
    narrow = CatalogVersions(versions.current, versions.layout, versions.device, max_steps=versions.max_steps - 1)
    with pytest.raises(CatalogError, match="decode steps"):
        narrow.load(path)


def test_the_prefix_cache_holds_across_catalog_versions(fresh, tmp_path, rng):
    """A catalog does not change K/V: a prompt cached before the swap is a hit after it."""
    prompt = random_prompt(fresh, 64, rng)
    full_width(fresh, prompt, cache_scope="u")
    hits = fresh.scheduler.cache.stats.hits
    fresh.load_catalog(write_subset(fresh.catalog, np.arange(0, len(fresh.catalog), 2), tmp_path / "v2.parquet"))
    full_width(fresh, prompt, cache_scope="u")
    assert fresh.scheduler.cache.stats.hits > hits


def test_score_and_recommend_name_the_catalog_version(fresh, tmp_path, rng):
    from genrec.api import Candidate, RecommendRequest

    prompt = random_prompt(fresh, 8, rng)
    path = write_subset(fresh.catalog, np.arange(0, len(fresh.catalog), 2), tmp_path / "v2.parquet")
    fresh.load_catalog(path)
    items = [Candidate(item_id=fresh.catalog.item_ids[0])]
    (scored,) = fresh.score([ScoreRequest(prompt_token_ids=prompt, candidates=items)])
    (recommended,) = fresh.recommend([RecommendRequest(prompt_token_ids=prompt, beam_width=4, candidates=items)])
    assert scored.catalog_version == recommended.catalog_version == catalog_version(path)


def test_a_ranker_has_no_live_catalog(ranker):
    with pytest.raises(CatalogError, match="no catalog to change live"):
        ranker.load_catalog("anything.parquet")


def test_a_version_no_longer_served_drops_its_compiled_filters(fresh, tmp_path, rng):
    """Masks live on the device: the replaced version's are freed (a rollback compiles them again)."""
    prompt = random_prompt(fresh, 8, rng)
    allowed = fresh.catalog.item_ids[:20].tolist()
    first = fresh.family.catalogs.current
    full_width(fresh, prompt, allowed_item_ids=allowed)
    assert len(first.filters) == 1 and first.filters.nbytes > 0
    fresh.load_catalog(write_subset(fresh.catalog, np.arange(0, len(fresh.catalog), 2), tmp_path / "v2.parquet"))
    assert len(first.filters) == 0 and first.filters.nbytes == 0
    late = first.filters.get(RetrieveRequest(prompt_token_ids=prompt, allowed_item_ids=allowed[:5]))
    assert late.allowed == 5 and len(first.filters) == 0  # prepared just before the swap: compiled, not kept
    fresh.rollback_catalog()
    result = full_width(fresh, prompt, allowed_item_ids=allowed)
    assert {i.item_id for i in result.items} == set(allowed) and len(first.filters) == 1


def test_a_file_whose_name_carries_another_hash_is_refused(fresh, tiny_dir, tmp_path):
    """A catalog named by its hash (`genrec catalog` writes catalog-<hash12>.parquet) is checked against it when
    loaded, live and at start: a file changed after it was written is never served under its name."""
    import shutil

    from genrec.catalog.catalog import named_hash, versioned_name

    running = fresh.family.catalogs.current
    subset = write_subset(fresh.catalog, np.arange(40), tmp_path / "subset.parquet")
    version = catalog_version(subset)
    named = tmp_path / versioned_name(version)
    shutil.copy(subset, named)
    assert named.name == f"catalog-{version[:12]}.parquet" and named_hash(named) == version[:12]
    assert named_hash(subset) is None and named_hash(tmp_path / "catalog-ABC.parquet") is None
    lying = tmp_path / versioned_name("0" * 16)
    shutil.copy(subset, lying)
    also_running = tmp_path / versioned_name("f" * 16)  # the running version's bytes: no rollback shortcut either
    shutil.copy(tiny_dir / "genrec" / "catalog.parquet", also_running)
    for path in (lying, also_running):
        with pytest.raises(CatalogError, match=rf"{path}: its content hash is [0-9a-f]{{12}}, not the [0f]{{12}} its"):
            fresh.load_catalog(path)
        with pytest.raises(CatalogError, match="its name carries"):
            Catalog.load(path)  # the start-up path (a model directory's catalog, a config's)
        assert fresh.family.catalogs.current is running
    assert fresh.load_catalog(named)["catalog_version"] == version


def test_a_pass_whose_later_selection_fails_leaves_every_cohort_as_it_was(fresh, tmp_path, rng, monkeypatch):
    """Two catalog versions' requests in one decode pass: one selection each. The selection that runs second fails
    at the last level. The first must not have moved: the retry runs each request alone, and a request already
    moved past its last level would fail there."""
    from genrec.engine import selection as selection_module

    first = fresh.catalog
    prompt = random_prompt(fresh, 9, rng)
    prepared, alone = [fresh.prepare(RetrieveRequest(prompt_token_ids=prompt, beam_width=len(first)))], []
    alone.append(full_width(fresh, prompt))
    fresh.load_catalog(write_subset(first, np.arange(1, len(first), 4), tmp_path / "v2.parquet"))
    prepared.append(fresh.prepare(RetrieveRequest(prompt_token_ids=prompt, beam_width=len(first))))
    alone.append(full_width(fresh, prompt))
    # A pass runs its selections in the order of their tries' ids: the later one fails.
    later = max((0, 1), key=lambda k: id(prepared[k].served.trie))
    original, failed = selection_module.select_together, []

    def failing_at_the_last_level(selection, gains):
        cohort = selection.cohorts[0]
        if cohort.trie is prepared[later].served.trie and cohort.level == cohort.trie.levels - 1:
            failed.append(cohort.level)
            raise RuntimeError("injected")
        return original(selection, gains)

    monkeypatch.setattr(selection_module, "select_together", failing_at_the_last_level)
    outcomes = dict(fresh._execute(list(enumerate(prepared))))
    assert failed and isinstance(outcomes[later], RuntimeError)
    kept = outcomes[1 - later]
    assert not isinstance(kept, Exception), kept
    expected = alone[1 - later]
    assert [i.item_id for i in kept.items] == [i.item_id for i in expected.items]
    assert [i.logprob for i in kept.items] == pytest.approx([i.logprob for i in expected.items], abs=1e-4)
    assert kept.catalog_version == expected.catalog_version
