"""`genrec bench funnel`: the two-stage recommend (Qwen3 retrieval, then HSTU ranking) against retrieval alone.

One local Serve app with a ranker (genrec.serving.app; funnel.py), over HTTP on 127.0.0.1, one request at a time:
POST /v1/recommend with a `history` (both stages) and POST /v1/retrieve (the same prompt and beam width)
alternate, each user's prompt and history drawn once and sent on both routes. The ratio of their p50s says what
the ranking stage costs on top of retrieval (goal: <= 1.5 at the demo's sizes).
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from genrec.bench.common import machine, random_prompt
from genrec.engine import Engine
from genrec.errors import GenrecError

APP = "funnel"
GOAL = 1.5


def run(model: Path | None, ranker: Path | None, prompt_len: int, beam_width: int, events: int, requests: int,
        users: int, warmup: int) -> dict:  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="genrec-funnel-") as scratch:
        model, ranker = _model_dirs(model, ranker, Path(scratch))
        bodies = _bodies(model, ranker, prompt_len, beam_width, events, users)
        with _local_funnel(model, ranker) as url:
            timed = _measure(url, bodies, requests, warmup)
    two_stage, retrieve, stage1 = (_summary(timed[k]) for k in ("two_stage", "retrieve", "recommend"))
    return {
        "benchmark": "funnel",
        "model": str(model),
        "ranker": str(ranker),
        "prompt_tokens": prompt_len,
        "beam_width": beam_width,
        "history_events": events,
        "ranked_candidates_median": statistics.median(timed["ranked"]),
        "users": users,
        "requests_each": requests,
        "two_stage": two_stage,
        "retrieve": retrieve,
        "recommend_without_history": stage1,
        "ratios": {
            "two_stage_p50_over_retrieve_p50": two_stage["p50_ms"] / retrieve["p50_ms"],
            "two_stage_p90_over_retrieve_p90": two_stage["p90_ms"] / retrieve["p90_ms"],
        },
        "goals": {"two_stage_p50_over_retrieve_p50": f"<= {GOAL}"},
        "note": "one request at a time over HTTP, the two routes alternating; each engine replica has one torch "
        "thread; two-stage = /v1/recommend with history: retrieval (every beam) then the ranker",
        "machine": machine(),
    }


def _model_dirs(model: Path | None, ranker: Path | None, scratch: Path) -> tuple[Path, Path]:
    """The given directories, else tiny ones of the demo's shapes (hidden 64, 2 layers, random weights)."""
    if model is None:
        from genrec.model.tiny import ModelSpec, write_model_dir

        model = write_model_dir(scratch / "qwen3", ModelSpec(hidden=64, layers=2))
    if ranker is None:
        from genrec.model.hstu_tiny import HSTUSpec, write_hstu_dir

        ranker = write_hstu_dir(scratch / "hstu", HSTUSpec(hidden=64, layers=2))
    return Path(model), Path(ranker)


def _bodies(model: Path, ranker: Path, prompt_len: int, beam_width: int, events: int, users: int) -> list[dict]:
    """One two-stage body per user: a random prompt of ordinary tokens and a history of the ranker's items."""
    retriever, hstu = Engine.from_pretrained(model), Engine.from_pretrained(ranker)
    g = torch.Generator().manual_seed(0)
    items, actions = hstu.catalog.item_ids, hstu.model.config.num_actions
    bodies = []
    for _ in range(users):
        picks = torch.randint(0, len(items), (events,), generator=g).tolist()
        kinds = torch.randint(0, actions, (events,), generator=g).tolist()
        history = [
            {"item_id": items[i], "action": a, "timestamp": 1e9 + 60.0 * t}
            for t, (i, a) in enumerate(zip(picks, kinds, strict=True))
        ]
        prompt = random_prompt(retriever, prompt_len, g)
        bodies.append({"prompt_token_ids": prompt, "beam_width": beam_width, "history": history})
    return bodies


def _measure(url: str, bodies: list[dict], requests: int, warmup: int) -> dict[str, list[float]]:
    timed = {"two_stage": [], "retrieve": [], "recommend": [], "ranked": []}
    with httpx.Client(timeout=120) as client:
        for i in range(warmup + requests):
            body = bodies[i % len(bodies)]
            retrieve = {k: v for k, v in body.items() if k != "history"}  # the same prompt and beam
            calls = [("two_stage", "recommend", body), ("retrieve", "retrieve", retrieve)]
            calls.append(("recommend", "recommend", retrieve))  # stage 1 alone: what the ranking stage adds to
            for name, route, sent in calls[:: 1 if i % 2 else -1]:  # alternate which goes first
                started = time.perf_counter()
                response = client.post(f"{url}/v1/{route}", json=sent)
                elapsed = time.perf_counter() - started
                if response.status_code != 200:
                    raise GenrecError(f"/v1/{route}: HTTP {response.status_code}: {response.text[:300]}")
                if i >= warmup:
                    timed[name].append(elapsed)
                    if name == "two_stage":
                        items = response.json()["items"]
                        timed["ranked"].append(sum(item["ranker_scores"] is not None for item in items))
    return timed


def _summary(seconds: list[float]) -> dict:
    q = statistics.quantiles(seconds, n=10)
    return {"p50_ms": 1000 * statistics.median(seconds), "p90_ms": 1000 * q[8], "n": len(seconds)}


@contextlib.contextmanager
def _local_funnel(model: Path, ranker: Path):
    """The funnel app (ingress, one retriever and one ranker replica, one torch thread each) on a local Ray."""
    from ray import serve

    from genrec.bench.serve import local_serve_session
    from genrec.serving.app import build_app
    from genrec.serving.args import AppArgs

    one_thread = {"torch_threads": 1, "engine_num_cpus": 0.5}
    args = AppArgs(
        model_dir=str(model),
        ranker={"model_dir": str(ranker), **one_thread},
        ingress_num_cpus=0.1,
        request_timeout_s=120,
        **one_thread,
    )
    with local_serve_session() as base:
        serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
        yield f"{base}/{APP}"
