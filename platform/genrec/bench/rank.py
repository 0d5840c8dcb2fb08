"""`genrec bench rank`: HSTU ranking of many candidates after a long history, against its baselines.

In the same run, interleaved: the engine's one pass (history once, every candidate a row over it) against one
request per candidate (a sample of them timed, scaled to all) and against the plain forward of the whole
[history + candidates] sequence under the dense ranking mask; then a returning user's request (the history
cached, `new_events` more) against the same request cold.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from genrec.api import Event, RankRequest
from genrec.bench.common import interleaved_medians, machine, synchronize
from genrec.engine import Engine, SchedulerConfig
from genrec.engine.scheduler import Scheduler
from genrec.model.hstu_tiny import preset, write_hstu_dir


def model_dir(name: str, root: Path) -> Path:
    target = root / f"hstu-{name}"
    if not (target / "genrec" / "catalog.parquet").exists():
        write_hstu_dir(target, preset(name))
    return target


def requests(engine: Engine, events: int, candidates: int, seed: int = 0) -> RankRequest:
    g = torch.Generator().manual_seed(seed)
    items = engine.catalog.item_ids
    picks = torch.randint(0, len(items), (events + candidates,), generator=g).tolist()
    actions = torch.randint(0, engine.model.config.num_actions, (events,), generator=g).tolist()
    history = [
        Event(item_id=items[i], action=a, timestamp=1e9 + 60.0 * t)
        for t, (i, a) in enumerate(zip(picks[:events], actions, strict=True))
    ]
    return RankRequest(history=history, candidates=[items[i] for i in picks[events:]])


@torch.inference_mode()
def plain_masked_forward(engine: Engine, request: RankRequest) -> torch.Tensor:
    """The whole [history + candidates] sequence in one forward with the dense ranking mask: the baseline."""
    model, prepared = engine.model, engine.prepare(request)
    T, C = len(prepared.token_ids), len(prepared.candidate_rows)
    events = prepared.token_ids
    items = torch.cat([events[:, 0], torch.as_tensor(prepared.candidate_rows)])
    actions = torch.cat([events[:, 1], torch.full((C,), model.config.no_action)])
    buckets = torch.cat([events[:, 2], torch.full((C,), model.config.unknown_bucket)])
    positions = torch.cat([torch.arange(T), torch.full((C,), T)])
    x = model.embed_events(items, actions, positions, buckets if model.config.num_time_buckets else None)
    mask = torch.ones(T + C, T + C, dtype=torch.bool).tril()
    mask[T:, T:] = torch.eye(C, dtype=torch.bool)
    for layer in model.layers:
        u, v, q, k = layer.project(x)
        scores = F.silu(torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)) * model.scale) * mask
        attn = torch.matmul(scores, v.transpose(0, 1)).transpose(0, 1)
        x = layer.finish(x, u, attn * model.inv_normalizer)
    return model.task_probs(x[T:])


def warm_and_cold(engine: Engine, request: RankRequest, new_events: int, repeats: int, device: str) -> dict:
    """A returning user: the history cached, `new_events` more each visit; the same requests with no cache."""
    out = {}
    for name, cache in (("cold", 0), ("warm", None)):
        scheduler = Scheduler(engine, SchedulerConfig(prefix_cache_bytes=cache, request_timeout_s=600))
        history, times = list(request.history), []
        for visit in range(repeats + 1):
            last = history[-1].timestamp
            more = [
                Event(item_id=e.item_id, timestamp=last + 60.0 * (j + 1)) for j, e in enumerate(history[:new_events])
            ]
            history = history + more
            prepared = engine.prepare(request.model_copy(update={"history": history}))
            synchronize(device)
            start = time.perf_counter()
            scheduler.submit(prepared)
            while not scheduler.idle:
                scheduler.step()
            synchronize(device)
            if visit:  # the first visit fills the cache
                times.append(time.perf_counter() - start)
        out[f"{name}_s"] = statistics.median(times)
    out["cold_over_warm"] = out["cold_s"] / out["warm_s"]
    return out


def run(preset_name, model, device, events, candidates, repeats, fanout_sample, new_events, root: Path) -> dict:
    path = model or model_dir(preset_name, root)
    engine = Engine.from_pretrained(path, device=device, scheduler=SchedulerConfig(prefix_cache_bytes=0))
    request = requests(engine, events, candidates)
    singles = [request.model_copy(update={"candidates": [c]}) for c in request.candidates[:fanout_sample]]
    seconds = interleaved_medians(
        {
            "genrec_one_pass": lambda: engine.rank([request]),
            "one_request_per_candidate_sample": lambda: [engine.rank([s]) for s in singles],
            "plain_masked_forward": lambda: plain_masked_forward(engine, request),
        },
        repeats,
        device,
    )
    fanout_s = seconds.pop("one_request_per_candidate_sample") * candidates / len(singles)
    seconds["one_request_per_candidate"] = fanout_s
    one = seconds["genrec_one_pass"]
    warm = warm_and_cold(engine, request, new_events, repeats, device)
    return {
        "benchmark": "rank",
        "model": str(path),
        "preset": None if model else preset_name,
        "device": device,
        "history_events": events,
        "candidates": candidates,
        "fanout_timed": len(singles),
        "repeats": repeats,
        "seconds": seconds,
        "returning": warm,
        "ratios": {
            "one_request_per_candidate_over_one_pass": fanout_s / one,
            "one_pass_over_plain_masked_forward": one / seconds["plain_masked_forward"],
            "cold_over_warm": warm["cold_over_warm"],
        },
        "machine": machine(),
    }
