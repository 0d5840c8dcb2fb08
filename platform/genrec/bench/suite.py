"""`genrec bench suite`: the benchmark runs a machine is asked for, in priority order, one JSON file each.

Each run is isolated: a failure is written as its own JSON and the suite goes on, so a time-limited
device session still returns everything that finished.
"""

from __future__ import annotations

import json
import tempfile
import time
import traceback
from pathlib import Path


def gpu_consistency(device: str) -> dict:
    """The same tiny model in float32 on CPU and on the device: same beams, same scores."""
    import torch

    from genrec.api import Candidate, RetrieveRequest, ScoreRequest
    from genrec.engine import Engine
    from genrec.model.tiny import ModelSpec, write_model_dir

    model_dir = write_model_dir(Path(tempfile.mkdtemp()) / "m", ModelSpec(items=300, levels=3, codebook=8))
    cpu = Engine.from_pretrained(model_dir, device="cpu", dtype=torch.float32)
    dev = Engine.from_pretrained(model_dir, device=device, dtype=torch.float32)
    retrieve = [RetrieveRequest(prompt_token_ids=list(range(5, 5 + n)), beam_width=w) for n, w in ((40, 300), (7, 5))]
    score = [ScoreRequest(prompt="user liked", candidates=[Candidate(item_id=i) for i in cpu.catalog.item_ids[:50]])]
    a, b = cpu.retrieve(retrieve), dev.retrieve(retrieve)
    same_items = all([i.item_id for i in x.items] == [i.item_id for i in y.items] for x, y in zip(a, b, strict=True))
    logprob_diff = max(
        abs(i.logprob - j.logprob) for x, y in zip(a, b, strict=True) for i, j in zip(x.items, y.items, strict=False)
    )
    sa, sb = cpu.score(score)[0], dev.score(score)[0]
    score_diff = max(abs(i.logprob - j.logprob) for i, j in zip(sa.scores, sb.scores, strict=True))
    return {"same_items": same_items, "max_logprob_diff": logprob_diff, "max_score_diff": score_diff}


def runs(device: str, preset: str):
    from genrec.bench import load, retrieve, score

    yield "consistency", lambda: gpu_consistency(device)
    for running in (64, 16, 8):
        yield (
            f"load-2000-30-5-running{running}",
            lambda r=running: load.run(
                "retrieve", [8, 16, 24, 32], 6.0, preset, None, 5, 2000, 30, 100, device, 64, None, r
            ),
        )
    yield "retrieve-2000-30-5", lambda: retrieve.run(2000, 30, preset, None, 5, 1, device, 5, True, True)
    yield "retrieve-1000-256-3", lambda: retrieve.run(1000, 256, preset, None, 3, 1, device, 5, True, False)
    yield "score-1000-500", lambda: score.run(1000, 500, 0, preset, None, device, 5, 50)
    yield "retrieve-batch8-2000-30-5", lambda: retrieve.run(2000, 30, preset, None, 5, 8, device, 3, False, False)


def run_suite(device: str, preset: str, out: Path, only: list[str] | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for name, fn in runs(device, preset):
        if only and name not in only:
            continue
        start = time.perf_counter()
        try:
            report = fn()
            status = "ok"
        except Exception as err:  # noqa: BLE001 - recorded, the suite goes on
            report = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            status = "error"
        report["wall_seconds"] = time.perf_counter() - start
        (out / f"{name}.json").write_text(json.dumps(report, indent=2))
        summary[name] = {"status": status, "ratios": report.get("ratios"), "wall_seconds": report["wall_seconds"]}
        print(json.dumps({name: summary[name]}), flush=True)
    return summary
