"""Malformed and extreme requests end in a result or a GenrecError: never another exception, a crash or a hang.

Cases that once killed the process (SIGFPE in a CPU attention kernel) run in a fresh interpreter, so a
regression fails its test instead of taking pytest down with it.
"""

import asyncio
import subprocess
import sys
from pathlib import Path

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


# -- a recommend that excludes the whole catalog (it crashed the process: issue 13, item 1) ---------------


def excluded_everything(model_dir: str) -> None:
    from genrec.engine import AsyncEngine, Engine

    engine = Engine.from_pretrained(model_dir)
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
    print("ok")


def _same_items(got, want) -> None:
    assert [i.item_id for i in got.items] == [i.item_id for i in want.items]
    assert all(abs(a.score_logprob - b.score_logprob) < 1e-4 for a, b in zip(got.items, want.items, strict=True))


def test_recommend_excluding_the_whole_catalog_returns_no_items_alone_batched_and_async(tiny_dir):
    assert run_isolated("tests.test_engine_robustness:excluded_everything", tiny_dir).strip().endswith("ok")
