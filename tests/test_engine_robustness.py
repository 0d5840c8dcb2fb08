"""Malformed and extreme requests end in a result or a GenrecError: never another exception, a crash or a hang.

The checks run in a fresh interpreter (one for the module): a request that kills the process (it once did,
with SIGFPE in a CPU attention kernel) or hangs it fails these tests instead of taking pytest down.
"""

import asyncio
import json
import random
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from genrec.api import Candidate, RecommendRequest

ROOT = Path(__file__).resolve().parent.parent


def run_isolated(target: str, *args, timeout_s: float = 120) -> str:
    """Run `tests.module:function(*args)` in a fresh interpreter; its stdout. A crash or a hang fails the test."""
    module, name = target.split(":")
    code = f"import sys; from {module} import {name}; {name}(*sys.argv[1:])"
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
    )
    assert proc.returncode == 0, f"{target} exited with {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    return proc.stdout


def isolated_checks(model_dir: str, seed: str, count: str) -> None:
    """The child process: every check below on one engine; prints one JSON report (a failure's traceback)."""
    from genrec.engine import Engine

    engine = Engine.from_pretrained(model_dir)
    report = {}
    for name, check in (("excluded_everything", excluded_everything), ("fuzz", fuzz)):
        try:
            report[name] = check(engine, random.Random(int(seed)), int(count))
        except Exception:  # noqa: BLE001
            report[name] = {"failed": traceback.format_exc()}
    print(json.dumps(report))


@pytest.fixture(scope="module")
def isolated(tiny_dir):
    return json.loads(run_isolated("tests.test_engine_robustness:isolated_checks", tiny_dir, 13, 100).splitlines()[-1])


# -- a recommend that excludes the whole catalog (it crashed the process: issue 13, item 1) ---------------


def excluded_everything(engine, rng, count) -> str:
    from genrec.engine import AsyncEngine

    everything = list(engine.catalog.item_ids)
    nothing_left = RecommendRequest(prompt="user liked", beam_width=4, exclude_item_ids=everything)
    other = RecommendRequest(prompt="user played the show", beam_width=4, num_results=3)

    (alone,) = engine.recommend([nothing_left])
    assert alone.items == [] and alone.prompt_tokens > 0
    empty, full = engine.recommend([nothing_left, other])
    assert empty.items == []
    _same_items(full, engine.recommend([other])[0])
    with_given = nothing_left.model_copy(update={"candidates": [Candidate(text="news daily")]})
    (given,) = engine.recommend([with_given])
    assert [(i.item_id, i.source) for i in given.items] == [(None, "given")]

    async def two_into_a_running_engine():
        ae = AsyncEngine(engine)
        try:
            return await asyncio.wait_for(
                asyncio.gather(ae.recommend(nothing_left), ae.recommend(nothing_left), ae.recommend(other)), 60
            )
        finally:
            ae.shutdown()

    first, second, third = asyncio.run(two_into_a_running_engine())
    assert first.items == [] and second.items == []
    _same_items(third, full)
    return "ok"


def _same_items(got, want) -> None:
    assert [i.item_id for i in got.items] == [i.item_id for i in want.items]
    assert all(abs(a.score_logprob - b.score_logprob) < 1e-4 for a, b in zip(got.items, want.items, strict=True))


def test_recommend_excluding_the_whole_catalog_returns_no_items_alone_batched_and_async(isolated):
    assert isolated["excluded_everything"] == "ok", isolated["excluded_everything"]["failed"]


# -- randomized: malformed and extreme requests at Engine and AsyncEngine --------------------------------


def random_fields(rng, engine) -> tuple[str, dict]:
    """One request's kind and fields. Most draws are valid for the model but extreme for the engine (huge prompts
    and beams, excluded-everything, duplicate, unknown and excluded candidates, overflowing embeddings); about a
    third are "wild" and may also hold what the model itself must refuse (bools, strings, surrogates, ...)."""
    items, dim = list(engine.catalog.item_ids), engine.family.projector.user_dim
    vocab, room = engine.model.config.vocab_size, engine.family.max_prompt_tokens
    wild = rng.random() < 0.3

    def pick(edges, invalid=()):
        return rng.choice(list(edges) + (list(invalid) if wild else []))

    fields: dict = {}
    prompt = pick(
        ["text", "text", "tokens", "tokens", "long", "huge_text", "huge_tokens", "odd"], ["empty", "surrogate"]
    )
    if prompt == "text":
        fields["prompt"] = " ".join(rng.choice(["user", "liked", "news", "show"]) for _ in range(rng.randint(1, 30)))
    elif prompt == "tokens":
        fields["prompt_token_ids"] = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        if rng.random() < 0.3:
            fields["prompt_token_ids"].append(pick([vocab, 10**12], [-1, True, "7", 2.0]))
    elif prompt == "huge_text":
        fields["prompt"] = "user liked the show " * rng.choice([10, room])
    elif prompt == "long":
        fields["prompt_token_ids"] = [rng.randrange(vocab) for _ in range(rng.randint(300, 900))]
    elif prompt == "huge_tokens":  # past the model's positions (one prompt at the limit is drawn in `fuzz`)
        fields["prompt_token_ids"] = [1] * (room + rng.choice([1, 1000]))
    elif prompt == "odd":
        fields["prompt"] = rng.choice(["\x00", "🎧 podcast 🎧", "\u202e liked", "<a_0><b_1><c_2>", "<|user|>"])
    else:
        fields.update(
            {"empty": {"prompt": rng.choice(["", "  "])}, "surrogate": {"prompt": "user \ud800 liked"}}[prompt]
        )
    if rng.random() < 0.4:
        values = pick([0.5, -2.0, 1, 0.0, 1e30, 3e38, -3e38, 1e300], [float("nan"), float("inf"), True, "0.5"])
        size = pick([dim, dim, dim, dim + 1], [0])
        fields["user_embedding"] = [values if rng.random() < 0.3 else rng.gauss(0, 1) for _ in range(size)]
        if rng.random() < 0.8 and "prompt" in fields:
            fields["prompt"] = "<|user|> " + fields["prompt"]
    kind = rng.choice(["retrieve", "score", "recommend"])
    if kind != "score":
        fields["beam_width"] = pick([1, 2, 7, 30, 300, 1024], [1025, 0, True, 4.0])
        if rng.random() < 0.3:
            fields["num_results"] = pick([1, 5], [2000, "3"])
            fields["beam_width"] = (
                max(fields["num_results"], fields["beam_width"]) if not wild else fields["beam_width"]
            )
        exclude = rng.choice(["none", "some", "unknown", "everything", "duplicates"])
        fields["exclude_item_ids"] = {
            "none": [],
            "some": rng.sample(items, 20),
            "unknown": ["nope", ""],
            "everything": items,
            "duplicates": [items[3]] * 5,
        }[exclude]
    if kind != "retrieve":
        count = pick([1, 3, 50] + ([0] if kind == "recommend" else []), [0, engine.family.max_candidates + 1])
        excluded = fields.get("exclude_item_ids") or items
        fields["candidates"] = [random_candidate(rng, items, excluded, vocab, pick) for _ in range(count)]
        if rng.random() < 0.15:
            fields["labels"] = pick([("no", "yes"), ("yes", "yes"), ("news daily", "no"), ("", "no")], [("yes",)])
    if rng.random() < 0.2:
        fields["request_id"] = pick(["r1", "🎧"], ["\udc80", 7])
    return kind, fields


def random_candidate(rng, items, excluded, vocab, pick) -> dict:
    form = pick(["item", "item", "excluded", "unknown", "text", "tokens", "far_tokens"], ["bad", "surrogate", "two"])
    return {
        "item": {"item_id": rng.choice(items[:20])},  # a small pool: duplicates are frequent
        "excluded": {"item_id": rng.choice(excluded)},
        "unknown": {"item_id": "no-such-item"},
        "text": {"text": rng.choice(["news daily", "🎧", "  x  "])},
        "tokens": {"token_ids": [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]},
        "far_tokens": {"token_ids": [vocab + 5]},
        "bad": {"token_ids": [rng.choice([-3, False, 1.5])]},
        "surrogate": {"text": "\ud83d"},
        "two": {"item_id": items[0], "text": "x"},
    }[form]


def outcome(value) -> str:
    """'ok', or the class of a deliberate error; anything else is reported as a violation."""
    from genrec.errors import GenrecError

    if isinstance(value, GenrecError):
        return type(value).__name__
    if isinstance(value, BaseException):
        raise AssertionError(f"not a GenrecError: {type(value).__name__}: {value}") from value
    rows = value.scores if hasattr(value, "scores") else value.items
    numbers = [v for row in rows for v in row.model_dump().values()]
    assert all(v == v for v in numbers if isinstance(v, float)), f"a NaN in {value}"
    return "ok"


def fuzz(engine, rng, count: int) -> dict:
    """`count` drawn requests, each alone through Engine, then all at once through one AsyncEngine: every one
    ends in a result (no NaN in it) or a GenrecError, and the same one both ways. Plus mixed sync batches."""
    from pydantic import ValidationError

    from genrec.api import RetrieveRequest, ScoreRequest
    from genrec.engine import AsyncEngine

    classes = {"retrieve": RetrieveRequest, "score": ScoreRequest, "recommend": RecommendRequest}
    cases, refused = [], 0
    for _ in range(count):
        kind, fields = random_fields(rng, engine)
        try:
            request = classes[kind](**fields)
        except ValidationError:
            refused += 1  # the edge: the model refused it by field
            continue
        entry = kind if rng.random() < 0.85 else rng.choice(list(classes))  # sometimes the wrong entry
        cases.append((entry, request))
    at_the_limit = [
        1
    ] * engine.family.max_prompt_tokens  # the longest prompt, the widest beam: the last positions decode
    cases.append(("recommend", RecommendRequest(prompt_token_ids=at_the_limit, beam_width=1024, num_results=3)))

    def alone(entry, request):
        try:
            (result,) = getattr(engine, entry)([request])
        except Exception as err:  # noqa: BLE001
            return outcome(err)
        return outcome(result)

    sync = [alone(entry, request) for entry, request in cases]
    for _ in range(10):  # mixed batches: one result per request, or the whole batch refused
        entry = rng.choice(list(classes))
        batch = [r for e, r in rng.sample(cases, min(4, len(cases))) if e == entry]
        try:
            results = getattr(engine, entry)(batch)
        except Exception as err:  # noqa: BLE001
            outcome(err)
            continue
        assert [outcome(r) for r in results] == ["ok"] * len(batch)

    async def all_at_once():
        ae = AsyncEngine(engine)
        try:
            calls = [getattr(ae, entry)(request) for entry, request in cases]
            return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 120)
        finally:
            ae.shutdown()

    concurrent = [outcome(o) for o in asyncio.run(all_at_once())]
    assert concurrent == sync, [(c, s, e) for c, s, (e, _) in zip(concurrent, sync, cases, strict=True) if c != s]
    return {"refused_by_model": refused, "outcomes": {o: sync.count(o) for o in sorted(set(sync))}}


def test_random_malformed_and_extreme_requests_end_in_a_result_or_a_genrec_error(isolated):
    report = isolated["fuzz"]
    assert "failed" not in report, report["failed"]
    outcomes = report["outcomes"]
    assert (
        report["refused_by_model"] > 20 and outcomes.get("ok", 0) > 10 and outcomes.get("InvalidRequestError", 0) > 10
    )
