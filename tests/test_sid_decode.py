"""Beam search and scoring over open checkpoints' SID layouts: wrappers, endings, codes of different lengths and
codes shared by several items, against plain transformers references (exhaustive scoring, its beam search)."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from genrec.api import Candidate, RecommendRequest, RetrieveRequest, ScoreRequest
from genrec.catalog import Catalog
from genrec.engine import Engine, SchedulerConfig
from genrec.testing.tiny import ModelSpec, write_model_dir
from genrec_bench.reference import item_sequences
from tests.conftest import random_prompt
from tests.reference import exhaustive_retrieval, hf_constrained_beams, sequence_logprobs
from tests.sid_tokenizers import genrec_tokenizer, minionerec_tokenizer, openonerec_tokenizer

TOL = 1e-4
SMALL = dict(user_dim=0, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, intermediate=64)


def _served(path, tokenizer, item_ids, codes, popularity=None, layout=None, levels=3, codebook=4, arch="qwen3"):
    """A tiny random decoder directory (Qwen3, or Qwen2 as MiniOneRec's) with this tokenizer and catalog (and
    sid_layout.json): (engine, hf)."""
    spec = ModelSpec(items=8, levels=levels, codebook=codebook, seed=3, architecture=arch, **SMALL)
    write_model_dir(path, spec, tokenizer=tokenizer)
    if layout is not None:
        (path / "genrec" / "sid_layout.json").write_text(json.dumps(layout))
    catalog = Catalog.validated(np.array(item_ids, dtype=object), codes, None, popularity=popularity)
    catalog.save(path / "genrec" / "catalog.parquet")
    engine = Engine.from_pretrained(path, scheduler=SchedulerConfig(prefix_cache_bytes=0))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return engine, hf


@pytest.fixture(scope="module")
def openonerec(tmp_path_factory):
    """OpenOneRec's layout: <|sid_begin|><s_a_N><s_b_N><s_c_N><|sid_end|>, no disambiguating level: 30 codes, 12
    of them named by 2-3 items each, with popularity (ties included)."""
    tok = openonerec_tokenizer(levels=3, codebook=4)
    vocab = tok.get_vocab()
    rng = np.random.default_rng(7)
    flat = rng.choice(64, size=30, replace=False)
    distinct = [[vocab[f"<s_{letter}_{(f // 4 ** (2 - k)) % 4}>"] for k, letter in enumerate("abc")] for f in flat]
    codes = distinct + [distinct[k % 12] for k in range(18)]
    popularity = rng.integers(0, 3, size=len(codes)).astype(float)
    items = [f"v{i}" for i in range(len(codes))]
    engine, hf = _served(tmp_path_factory.mktemp("oor") / "model", tok, items, codes, popularity)
    return engine, hf, vocab


MINI = [  # MiniOneRec: 3 tokens, a 4th <d_k> on colliding items; one 3-token code is a prefix of a 4-token one
    ["<a_0>", "<b_3>", "<c_7>"],
    ["<a_0>", "<b_3>", "<c_7>", "<d_0>"],
    ["<a_0>", "<b_3>", "<c_7>", "<d_1>"],
    ["<a_101>", "<b_3>", "<c_2>"],
    ["<a_101>", "<b_250>", "<c_2>", "<d_0>"],
    ["<a_101>", "<b_250>", "<c_2>", "<d_1>"],
    ["<a_2>", "<b_250>", "<c_7>"],
    ["<a_2>", "<b_7>", "<c_11>"],
    ["<a_2>", "<b_7>", "<c_2>"],
    ["<a_13>", "<b_3>", "<c_11>"],
    ["<a_13>", "<b_7>", "<c_7>"],
    ["<a_13>", "<b_7>", "<c_7>"],  # RQ-VAE's leftover duplicate: one code, two items
]


@pytest.fixture(scope="module")
def minionerec(tmp_path_factory):
    tok = minionerec_tokenizer(MINI)
    vocab = tok.get_vocab()
    codes = [[vocab[t] for t in code] for code in MINI]
    items = [f"m{i}" for i in range(len(codes))]
    layout = {"preset": "minionerec"}
    path = tmp_path_factory.mktemp("mini") / "model"
    engine, hf = _served(path, tok, items, codes, layout=layout, levels=4, arch="qwen2")  # Qwen2.5, as MiniOneRec
    return engine, hf, vocab


def _grouped(result):
    """[(code, logprob, [item_id, ...])] from a result: items of one code are adjacent."""
    groups = []
    for item in result.items:
        if groups and groups[-1][0] == item.semantic_id:
            groups[-1][2].append(item.item_id)
        else:
            groups.append((item.semantic_id, item.logprob, [item.item_id]))
    return groups


def _assert_equal_rankings(got, want):
    assert [(code, items) for code, _, items in got] == [(code, items) for code, _, items in want]
    assert max(abs(a[1] - b[1]) for a, b in zip(got, want, strict=True)) <= TOL


@pytest.mark.parametrize("ends_with_begin", [False, True])
def test_openonerec_full_beam_equals_exhaustive(openonerec, rng, ends_with_begin):
    engine, hf, vocab = openonerec
    begin, end = vocab["<|sid_begin|>"], vocab["<|sid_end|>"]
    prompt = random_prompt(engine, 12, rng) + ([begin] if ends_with_begin else [])
    (result,) = engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=64)])
    catalog = engine.catalog
    want = exhaustive_retrieval(catalog, [end], hf, prompt[:12] + [begin], popularity=catalog.popularity)
    _assert_equal_rankings(_grouped(result), want)
    assert result.codes == 30 and len(result.items) == 48
    assert result.prompt_tokens == 13  # the begin token appended once, never twice
    assert all(begin not in i.semantic_id and end not in i.semantic_id for i in result.items)


@pytest.mark.parametrize("beam_width", [1, 4, 9])
def test_openonerec_beam_equals_transformers_beam_search(openonerec, rng, beam_width):
    """Every code is 3 tokens + <|sid_end|>: transformers' constrained beam search over the same sequences."""
    engine, hf, vocab = openonerec
    end = vocab["<|sid_end|>"]
    prompt = random_prompt(engine, 20, rng)
    (result,) = engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=beam_width)])
    sequences = np.unique(np.array(item_sequences(engine.catalog, [end])), axis=0)
    found, scores = hf_constrained_beams(hf, prompt + [vocab["<|sid_begin|>"]], sequences, beam_width, 0)
    got = _grouped(result)
    assert result.codes == beam_width == len(got)
    assert [code + [end] for code, _, _ in got] == found
    assert np.allclose([lp for _, lp, _ in got], scores, atol=TOL)


def test_shared_code_exclusion_keeps_the_other_items(openonerec, rng):
    engine, hf, vocab = openonerec
    prompt = random_prompt(engine, 15, rng)
    (plain,) = engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=3)])
    groups = _grouped(plain)
    shared = next(g for g in groups if len(g[2]) > 1)
    whole = groups[0][2] if groups[0] is not shared else groups[1][2]
    excluded = [shared[2][0], *whole]  # one item of a shared code, and every item of another code
    (result,) = engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=3, exclude_item_ids=excluded)])
    got = _grouped(result)
    assert result.codes == 3 and len(got) == 3  # the wholly excluded code gave its beam to the next code
    assert (shared[0], shared[2][1:]) in [(code, items) for code, _, items in got]
    assert not set(excluded) & {i.item_id for i in result.items}
    catalog = engine.catalog
    begin, end = vocab["<|sid_begin|>"], vocab["<|sid_end|>"]
    wide = RetrieveRequest(prompt_token_ids=prompt, beam_width=64, exclude_item_ids=excluded)
    (everything,) = engine.retrieve([wide])
    want = exhaustive_retrieval(catalog, [end], hf, prompt + [begin], excluded, catalog.popularity)
    _assert_equal_rankings(_grouped(everything), want)
    assert everything.codes == len(want) == 30 - 1


def test_minionerec_codes_of_3_and_4_tokens_equal_exhaustive(minionerec, rng):
    """Codes end with `\\n` then EOS, whose log-probabilities count: a 3-token code and its 4-token extension are
    both decodable, and their scores compare."""
    engine, hf, vocab = minionerec
    assert engine.family.levels == 6  # 4 code tokens + `\n` + EOS
    prompt = random_prompt(engine, 10, rng)
    (result,) = engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=64)])
    ending = engine.family.layout.ending
    _assert_equal_rankings(_grouped(result), exhaustive_retrieval(engine.catalog, ending, hf, prompt))
    assert result.codes == 11 and len(result.items) == 12
    assert {len(i.semantic_id) for i in result.items} == {3, 4}


@pytest.mark.parametrize("beam_width", [1, 2, 5])
def test_minionerec_narrow_beams_keep_finished_codes(minionerec, rng, beam_width):
    """A narrow beam over codes of different lengths: a finished code keeps its beam at its final score. At each
    step the kept prefixes are the best `beam_width` by the plain sum of their tokens' log-probabilities."""
    engine, hf, _ = minionerec
    prompt = random_prompt(engine, 10, rng)
    (result,) = engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=beam_width)])
    sequences = item_sequences(engine.catalog, engine.family.layout.ending)
    kept = [()]
    for step in range(max(map(len, sequences))):
        options = {tuple(s[: step + 1]) if len(s) > step else tuple(s) for s in sequences}
        options = [p for p in options if p[:step] in kept or (len(p) <= step and p in kept)]
        scores = sequence_logprobs(hf, prompt, [list(p) for p in options])
        kept = [p for _, p in sorted(zip(scores, options, strict=True), reverse=True)[:beam_width]]
    got = _grouped(result)
    ending = len(engine.family.layout.ending)
    assert [tuple(code) for code, _, _ in got] == [p[:-ending] for p in kept]


def test_score_and_recommend_follow_the_logprob_rule(openonerec, rng):
    """An item candidate is scored as the decode generates it (begin, code, end); its label is read after the end
    token; the labels default to the model's (是 / 否); recommend's code_logprob of a given item equals its beam
    logprob (the end token's log-probability counted)."""
    engine, hf, vocab = openonerec
    begin, end, yes = vocab["<|sid_begin|>"], vocab["<|sid_end|>"], vocab["是"]
    prompt = random_prompt(engine, 9, rng)
    items = ["v3", "v20", "v7"]
    (scored,) = engine.score([ScoreRequest(prompt_token_ids=prompt, candidates=[Candidate(item_id=i) for i in items])])
    catalog = engine.catalog
    for item, got in zip(items, scored.scores, strict=True):
        row = prompt + [begin, *catalog.code(catalog.index_of(item)), end]
        with torch.no_grad():
            logits = hf(torch.tensor([row])).logits[0, -1].float()
        assert abs(got.logprob - torch.log_softmax(logits, -1)[yes].item()) <= TOL
    (retrieved,) = engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=6)])
    assert len(retrieved.items) > retrieved.codes  # a shared code among them: its items share one scoring row
    found = {i.item_id for i in retrieved.items}
    given = next(f"v{k}" for k in range(30) if f"v{k}" not in found)
    request = RecommendRequest(
        prompt_token_ids=prompt, beam_width=6, candidates=[Candidate(item_id=given)], rank_by="joint"
    )
    (rec,) = engine.recommend([request])
    by_id = {i.item_id: i for i in rec.items}
    assert len(rec.items) == len(retrieved.items) + 1
    want = sequence_logprobs(hf, prompt + [begin], [[*catalog.code(catalog.index_of(given)), end]])[0]
    assert abs(by_id[given].code_logprob - want) <= TOL
    for item in retrieved.items:
        assert abs(by_id[item.item_id].retrieval_logprob - item.logprob) <= TOL
        assert abs(by_id[item.item_id].score_logprob - scored_alone(engine, prompt, item.item_id)) <= TOL


def scored_alone(engine, prompt, item_id):
    (result,) = engine.score([ScoreRequest(prompt_token_ids=prompt, candidates=[Candidate(item_id=item_id)])])
    return result.scores[0].logprob


def test_genrec_names_codes_of_different_lengths_without_ending(tmp_path, rng):
    """No ending: codes of 2 and 3 tokens, none a prefix of another, decode to exactly the exhaustive ranking."""
    tok = genrec_tokenizer(levels=3, codebook=4)
    vocab = tok.get_vocab()
    names = [["<a_0>", "<b_1>"], ["<a_0>", "<b_2>", "<c_0>"], ["<a_1>", "<b_1>", "<c_3>"], ["<a_2>", "<b_0>"]]
    codes = [[vocab[t] for t in code] for code in names]
    engine, hf = _served(tmp_path / "model", tok, ["w", "x", "y", "z"], codes)
    prompt = random_prompt(engine, 8, rng)
    (result,) = engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=4)])
    _assert_equal_rankings(_grouped(result), exhaustive_retrieval(engine.catalog, (), hf, prompt))
