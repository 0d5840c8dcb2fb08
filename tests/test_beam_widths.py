"""Per-level beam widths (`beam_widths`): equal to a textbook beam search with the same schedule, the budget
following the widest level, and bad schedules refused by field."""

import numpy as np
import pytest
import torch
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from pydantic import ValidationError

from genrec.api import RecommendRequest, RetrieveRequest
from genrec.engine.beam import _pass_bases, slots_needed, step_widths
from genrec.errors import InvalidRequestError
from genrec.serving.http_errors import validation_error_handler
from genrec.serving.schemas import RetrieveBody
from genrec_bench.reference import item_sequences
from tests.conftest import random_prompt
from tests.reference import scheduled_beam_search
from tests.sid_tokenizers import minionerec_tokenizer
from tests.test_sid_decode import MINI, _served

TOL = 1e-4


def codes_of(result) -> list[tuple[tuple[int, ...], float]]:
    """(code, logprob) of a result, one per code (the items of a shared code are adjacent)."""
    out = []
    for item in result.items:
        if not out or out[-1][0] != tuple(item.semantic_id):
            out.append((tuple(item.semantic_id), item.logprob))
    return out


def assert_equals_textbook(engine, hf, prompt, schedule):
    """The engine's beams under `schedule` against `scheduled_beam_search` over the catalog's sequences (code then
    the layout's ending; the ending steps keep the last width)."""
    ending = list(engine.family.layout.ending)
    (result,) = engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_widths=schedule)])
    sequences = item_sequences(engine.catalog, ending)
    want = scheduled_beam_search(hf, prompt, sequences, list(step_widths(engine.family.trie, schedule)))
    got = codes_of(result)
    assert [code for code, _ in got] == [seq[: len(seq) - len(ending)] for seq, _ in want]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want, strict=True)) <= TOL
    assert result.codes == len(want)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_schedule_equals_a_textbook_beam_search(arch_engine, arch_hf_model, seed):
    """Random schedules (narrowing, widening, both) on each decoder architecture."""
    engine = arch_engine
    generator = torch.Generator().manual_seed(seed)
    schedule = torch.randint(1, 13, (engine.catalog.levels,), generator=generator).tolist()
    prompt = random_prompt(engine, 12 + seed, generator)
    assert_equals_textbook(engine, arch_hf_model, prompt, schedule)


@pytest.mark.parametrize("schedule", [[1, 8, 64], [16, 2, 9], [3, 40, 1]])
def test_chosen_schedules_equal_a_textbook_beam_search(engine, hf_model, rng, schedule):
    """A first level narrower than the next (rows bounded by their children), a bottleneck, a single result."""
    assert_equals_textbook(engine, hf_model, random_prompt(engine, 20, rng), schedule)


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    """MiniOneRec's layout: codes of 3 and 4 tokens, then `\\n` and EOS (6 decode steps for 4 code levels)."""
    tok = minionerec_tokenizer(MINI)
    vocab = tok.get_vocab()
    codes = [[vocab[t] for t in code] for code in MINI]
    path = tmp_path_factory.mktemp("mini-widths") / "model"
    return _served(path, tok, [f"m{i}" for i in range(len(codes))], codes, layout={"preset": "minionerec"}, levels=4)


@pytest.mark.parametrize("schedule", [[1, 3, 2, 2], [4, 1, 5, 3], [2, 6, 6, 1], [5, 5, 5, 2]])
def test_codes_of_different_lengths_follow_the_schedule(mini, rng, schedule):
    """A level is a code token: finished 3-token codes keep their beams through the 4th level, which counts them
    under its width, and the ending steps keep the last width."""
    engine, hf = mini
    assert engine.catalog.levels == 4 and engine.family.levels == 6
    assert step_widths(engine.family.trie, schedule) == (*schedule, schedule[-1], schedule[-1])
    assert_equals_textbook(engine, hf, random_prompt(engine, 10, rng), schedule)


@pytest.mark.parametrize("schedule", [[4, 1, 5, 3], [5, 5, 5, 2]])
def test_passes_that_select_themselves_keep_finished_codes_through_the_pad_steps(tmp_path, rng, schedule):
    """MiniOneRec's layout with the selection inside the captured passes (the plan's `selects_in_graph`): a finished
    3-token code keeps its score through the 4th level (its pad step, `free`) as in the textbook beam search."""
    from tests.test_graph_capture import RecordedGraph, decode_passes, self_selecting

    tok = minionerec_tokenizer(MINI)
    vocab = tok.get_vocab()
    codes = [[vocab[t] for t in code] for code in MINI]
    path = tmp_path / "model"
    _, hf = _served(path, tok, [f"m{i}" for i in range(len(codes))], codes, layout={"preset": "minionerec"}, levels=4)
    engine = self_selecting(path)
    assert any(pads is not None for pads in engine.family.trie.free)
    assert_equals_textbook(engine, hf, random_prompt(engine, 10, rng), schedule)
    decode = RecordedGraph.made[: decode_passes(engine.runner)]
    assert sum(g.replays for g in decode) >= engine.family.levels - 1


@pytest.mark.parametrize("width", [1, 5, 64])
def test_a_constant_schedule_is_the_plain_beam_width(engine, rng, width):
    prompt = random_prompt(engine, 15, rng)
    (plain,) = engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=width)])
    (scheduled,) = engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_widths=[width] * 3)])
    assert [(i.item_id, i.logprob) for i in scheduled.items] == [(i.item_id, i.logprob) for i in plain.items]


def test_mixed_batch_with_and_without_schedules_equals_each_alone(engine, rng):
    requests = [
        RetrieveRequest(prompt_token_ids=random_prompt(engine, 9, rng), beam_widths=[2, 16, 8]),
        RetrieveRequest(prompt_token_ids=random_prompt(engine, 30, rng), beam_width=12),
        RetrieveRequest(prompt_token_ids=random_prompt(engine, 5, rng), beam_widths=[8, 4, 32], num_results=20),
        RetrieveRequest(
            prompt_token_ids=random_prompt(engine, 22, rng), beam_widths=[1, 1, 1], exclude_item_ids=["item-000004"]
        ),
        RetrieveRequest(prompt_token_ids=random_prompt(engine, 14, rng), beam_widths=[64, 64, 300]),
    ]
    together = engine.retrieve(requests)
    for request, result in zip(requests, together, strict=True):
        (alone,) = engine.retrieve([request])
        assert [i.item_id for i in result.items] == [i.item_id for i in alone.items]
        assert np.allclose([i.logprob for i in result.items], [i.logprob for i in alone.items], atol=1e-5)
    assert [len(r.items) for r in together] == [8, 12, 20, 1, 300]


def test_recommend_retrieves_with_the_schedule(engine, rng):
    prompt = random_prompt(engine, 16, rng)
    (retrieved,) = engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_widths=[2, 9, 6])])
    (recommended,) = engine.recommend([RecommendRequest(prompt_token_ids=prompt, beam_widths=[2, 9, 6])])
    got = {i.item_id: i.retrieval_logprob for i in recommended.items}
    assert set(got) == {i.item_id for i in retrieved.items}
    assert all(abs(got[i.item_id] - i.logprob) <= 1e-5 for i in retrieved.items)


def test_the_kv_budget_and_slots_follow_the_widest_level(engine):
    trie, decoder = engine.family.trie, engine.family
    widest = decoder.prepare(RetrieveRequest(prompt_token_ids=[5, 6], beam_width=64), "retrieve")
    scheduled = decoder.prepare(RetrieveRequest(prompt_token_ids=[5, 6], beam_widths=[4, 64, 8]), "retrieve")
    narrow = decoder.prepare(RetrieveRequest(prompt_token_ids=[5, 6], beam_width=8), "retrieve")
    assert scheduled.kv_tokens == widest.kv_tokens > narrow.kv_tokens
    # BeamKV slots: pass p holds the rows kept after step p-1, each bounded by its parents' children.
    children = trie.max_children
    assert _pass_bases(trie, [[4, 64, 8]]) == [0, 4, 4 + min(64, trie.nodes_at(2), 4 * children[1])]
    assert _pass_bases(trie, [[1, 64, 8]])[2] == 1 + children[1]  # one row cannot have more than its children
    assert slots_needed(trie, [[5, 5, 5]]) == slots_needed(trie, [5])
    assert slots_needed(trie, [[4, 64, 8], 7]) == slots_needed(trie, [[4, 64, 8]]) + slots_needed(trie, [7])


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"beam_widths": []}, "beam_widths"),
        ({"beam_widths": [4, 0, 4]}, "beam_widths.1"),
        ({"beam_widths": [4, 4, 1025]}, "beam_widths.2"),
        ({"beam_widths": [4, True, 4]}, "beam_widths.1"),
        ({"beam_widths": [4, 4.0, 4]}, "beam_widths.1"),
        ({"beam_widths": ["4", 4, 4]}, "beam_widths.0"),
        ({"beam_widths": 4}, "beam_widths"),
        ({"beam_widths": [4, 8, 16], "beam_width": 8}, "beam_widths"),
        ({"beam_widths": [4, 8, 16], "num_results": 17}, "num_results"),
    ],
)
def test_bad_schedules_fail_validation_naming_the_field(fields, fragment):
    with pytest.raises(ValidationError) as info:
        RetrieveRequest(prompt="a", **fields)
    assert fragment in str(info.value)


def test_beam_width_is_the_last_level_and_may_repeat_it():
    request = RetrieveRequest(prompt="a", beam_widths=[4, 8, 16], beam_width=16)
    assert request.beam_width == request.num_results == 16
    assert RetrieveRequest(prompt="a", beam_widths=[4, 8, 2]).beam_width == 2


@pytest.mark.parametrize("schedule", [[4, 4], [4, 4, 4, 4]])
def test_a_schedule_of_the_wrong_length_names_the_field(engine, schedule):
    with pytest.raises(InvalidRequestError) as info:
        engine.retrieve([RetrieveRequest(prompt_token_ids=[5, 6], beam_widths=schedule)])
    assert info.value.field == "beam_widths" and "3 levels" in str(info.value)


def _post(body: dict):
    app = FastAPI()
    app.add_exception_handler(RequestValidationError, validation_error_handler)

    @app.post("/v1/retrieve")
    def retrieve(body: RetrieveBody):
        return body.to_request(None).model_dump(include={"beam_width", "beam_widths"})

    return TestClient(app).post("/v1/retrieve", json=body)


def test_the_http_body_passes_the_schedule_and_names_a_bad_width():
    ok = _post({"prompt": "a", "beam_widths": [4, 8, 16], "user_id": "u1"})
    assert ok.status_code == 200 and ok.json() == {"beam_width": 16, "beam_widths": [4, 8, 16]}
    bad = _post({"prompt": "a", "beam_widths": [4, 0, 16]})
    assert bad.status_code == 422
    assert [d["field"] for d in bad.json()["details"]] == ["beam_widths[1]"]


def test_the_batch_job_retrieves_every_row_with_the_schedule(engine, tiny_dir, tmp_path, rng):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from genrec.batch import RecommendSpec
    from genrec.batch.stages import Retrieve
    from tests.shard_runs import error_rows, run_in_process

    prompts = [random_prompt(engine, 10 + k, rng) for k in range(3)]
    rows = [{"user_id": k, "prompt_token_ids": p} for k, p in enumerate(prompts)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "users.parquet")
    spec = RecommendSpec(
        model=str(tiny_dir), users=str(tmp_path / "users.parquet"), out=str(tmp_path / "out"), beam_widths=[2, 12, 6]
    )
    shard, _, report = run_in_process(Retrieve(spec))
    assert report["errors"] == 0 and error_rows(spec.out, shard) == []
    output = pq.read_table(tmp_path / "out" / "recommendations" / shard.name).to_pylist()
    differs = False  # from width 6 at every level, for some row: else the test could not tell the two apart
    for k, prompt in enumerate(prompts):
        (want,) = engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_widths=[2, 12, 6])])
        (constant,) = engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=6)])
        got = [r for r in output if r["user_id"] == k]
        assert [r["item_id"] for r in got] == [i.item_id for i in want.items]
        assert np.allclose([r["retrieval_logprob"] for r in got], [i.logprob for i in want.items], atol=1e-5)
        differs |= [i.item_id for i in constant.items] != [i.item_id for i in want.items]
    assert differs
