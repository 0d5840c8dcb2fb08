"""One in-process Engine call against its floor and baselines, timed round-robin in the same run.

- `bench retrieve`: Engine.retrieve vs one plain prefill of the prompts (the floor) vs transformers beam search;
  with --prefix-cache, also a miss of the prefix cache (the same prompts, each a new user's: keyed, looked up,
  held by the cache) against the cache off;
- `bench score`: one-pass scoring vs one transformers forward per candidate vs one plain forward of as many tokens;
- `bench rank`: HSTU ranking of many candidates after a long history, in one pass, vs one request per candidate (a
  sample timed, scaled to all) vs the plain forward of [history + candidates] under the dense ranking mask; then a
  returning user's request (history cached, `new_events` more) against the same request cold.

Every round repeats the same prompts, so the engines run with the prefix cache off (it would make them warm).
"""

from __future__ import annotations

import functools
import itertools
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from genrec.api import Candidate, Event, RankRequest, RetrieveRequest, ScoreRequest
from genrec.engine import Engine, SchedulerConfig
from genrec.engine.scheduler import Scheduler
from genrec.model.qwen3 import ContextKV
from genrec_bench import peer_vllm
from genrec_bench.cli import RankOptions, RetrieveOptions, ScoreOptions
from genrec_bench.common import (
    decoder,
    described,
    hstu_preset_dir,
    interleaved_medians,
    load_hf,
    machine,
    median_seconds,
    model_dir_for,
    random_prompt,
    timed,
)
from genrec_bench.reference import allowed_tokens_fn

COLD = SchedulerConfig(prefix_cache_bytes=0)


def retrieve(o: RetrieveOptions) -> dict:
    schedule = _schedule(o.beam_widths, o.beam_width)
    model_dir = model_dir_for(o.preset, o.model, o.levels)
    engine = Engine.from_pretrained(model_dir, device=o.device, cuda_fast=o.cuda_fast, scheduler=COLD)
    if schedule is not None and len(schedule) != engine.catalog.levels:
        raise ValueError(f"--beam-widths has {len(schedule)} widths; the catalog's codes have {engine.catalog.levels}")
    if o.peer:
        peer_vllm.check(o.peer, engine.model.config, o.device, o.beam_width)
    generator = torch.Generator().manual_seed(0)
    requests = [
        RetrieveRequest(prompt_token_ids=random_prompt(engine, o.prompt_len, generator), beam_width=o.beam_width)
        for _ in range(o.batch)
    ]
    prepared = [engine.prepare(r) for r in requests]
    calls = {
        "prefill_floor": lambda: [engine.runner.prefill_alone(p) for p in prepared],
        "genrec_retrieve": lambda: engine.retrieve(requests),
    }
    if o.user_embedding:
        soft = _soft_token_requests(engine, requests)
        calls["genrec_retrieve_soft_token"] = lambda: engine.retrieve(soft)
    if o.prefix_cache:
        calls["genrec_retrieve_cache_miss"] = _cache_misses(model_dir, o, requests)
    if schedule is not None:
        scheduled = [RetrieveRequest.model_validate(r.model_dump() | {"beam_widths": schedule}) for r in requests]
        calls["genrec_retrieve_scheduled"] = lambda: engine.retrieve(scheduled)
    seconds = interleaved_medians(calls, o.repeats, o.device)
    retrieve_s = seconds["genrec_retrieve"]
    report = {
        "benchmark": "retrieve",
        **described(model_dir, o, "device"),
        "dtype": str(engine.model.dtype),
        "prompt_len": o.prompt_len,
        "beam_width": o.beam_width,
        "levels": engine.catalog.levels,
        "items": len(engine.catalog),
        "batch": o.batch,
        "repeats": o.repeats,
        "seconds": seconds,
        "ratios": {"retrieve_over_prefill": retrieve_s / seconds["prefill_floor"]},
        "machine": machine(),
    }
    if o.user_embedding:
        report["ratios"]["soft_token_over_token_only"] = seconds["genrec_retrieve_soft_token"] / retrieve_s
    if o.prefix_cache:
        report["ratios"]["cache_miss_over_cache_off"] = seconds["genrec_retrieve_cache_miss"] / retrieve_s
    if schedule is not None:
        report["beam_widths"] = schedule
        report["ratios"]["scheduled_over_constant"] = seconds["genrec_retrieve_scheduled"] / retrieve_s
        report["scheduled_overlap"] = _overlap(engine.retrieve(scheduled), engine.retrieve(requests))
    if o.hf_baseline:
        hf_s, agreement = _hf_generate(engine, model_dir, requests, o.device, max(1, min(o.repeats, 2)))
        report["seconds"]["hf_generate"] = hf_s
        report["ratios"]["hf_over_retrieve"] = hf_s / retrieve_s
        report["hf_top_beam_agreement"] = agreement
    if o.peer:
        report[o.peer] = peer_vllm.compare_retrieve(engine, model_dir, requests, o.device, o.repeats)
    return report


def _schedule(text: str | None, beam_width: int) -> list[int] | None:
    """--beam-widths "32,128,256": positive widths, the last one --beam-width (both runs return as many items)."""
    if text is None:
        return None
    try:
        widths = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--beam-widths {text!r}: give comma-separated integers, e.g. 32,128,256") from None
    if min(widths) < 1:
        raise ValueError(f"--beam-widths {text!r}: every width must be at least 1")
    if widths[-1] != beam_width:
        raise ValueError(f"--beam-widths ends with {widths[-1]}: it must end with --beam-width ({beam_width})")
    return widths


def _overlap(scheduled, constant) -> float:
    """Of the items width B at every level finds, the share the schedule finds too (mean over requests)."""
    shares = []
    for a, b in zip(scheduled, constant, strict=True):
        want = {i.item_id for i in b.items}
        shares.append(len(want & {i.item_id for i in a.items}) / max(len(want), 1))
    return statistics.mean(shares)


def _cache_misses(model_dir, o: RetrieveOptions, requests):
    """A call that retrieves the requests on an engine with the prefix cache on (the default), each time as new
    users: every prompt keyed in its own scope, a miss, handed to the cache (which grows, then evicts)."""
    warm = Engine.from_pretrained(model_dir, device=o.device, cuda_fast=o.cuda_fast)
    visits = itertools.count()

    def call():
        visit = next(visits)
        return warm.retrieve(
            [r.model_copy(update={"cache_scope": f"user-{visit}-{i}"}) for i, r in enumerate(requests)]
        )

    return call


def _soft_token_requests(engine, requests):
    """The same requests with a `<|user|>` placeholder carrying a user vector in place of their first token."""
    parts = decoder(engine)
    if parts.projector is None:
        raise ValueError("--user-embedding needs a model with genrec/soft_token.safetensors")
    generator = torch.Generator().manual_seed(1)
    return [
        req.model_copy(
            update={
                "prompt_token_ids": [parts.placeholder_id] + req.prompt_token_ids[1:],
                "user_embedding": torch.randn(parts.projector.user_dim, generator=generator).tolist(),
            }
        )
        for req in requests
    ]


def _hf_generate(engine, model_dir: Path, requests, device, repeats):
    hf = load_hf(model_dir, device, engine.model.dtype)
    allowed, levels = allowed_tokens_fn(engine.catalog.codes), engine.catalog.levels

    def generate_all():
        outputs = []
        for req in requests:
            ids = torch.tensor([req.prompt_token_ids], device=device)
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                num_beams=req.beam_width,
                num_return_sequences=req.beam_width,
                max_new_tokens=levels,
                min_new_tokens=levels,
                do_sample=False,
                length_penalty=0.0,
                early_stopping=True,
                prefix_allowed_tokens_fn=lambda _b, seq, n=ids.shape[1]: allowed(seq[n:].tolist()),
                pad_token_id=decoder(engine).tokenizer.pad_token_id,
                eos_token_id=None,
            )
            outputs.append(out[:, ids.shape[1] :].tolist())
        return outputs

    seconds = median_seconds(generate_all, repeats, device, warmup=0)
    matches = [
        float(mine.items[0].semantic_id == theirs[0]) if mine.items else 0.0
        for mine, theirs in zip(engine.retrieve(requests), generate_all(), strict=True)
    ]
    return seconds, sum(matches) / len(matches)


def score(o: ScoreOptions) -> dict:
    model_dir = model_dir_for(o.preset, o.model, None)
    engine = Engine.from_pretrained(
        model_dir, device=o.device, max_candidates=max(o.candidates, 2048), cuda_fast=o.cuda_fast, scheduler=COLD
    )
    if o.peer:
        peer_vllm.check(o.peer, engine.model.config, o.device)
    generator = torch.Generator().manual_seed(0)
    prompt = random_prompt(engine, o.prefix_len, generator)
    if o.candidate_len:
        cands = [Candidate(token_ids=random_prompt(engine, o.candidate_len, generator)) for _ in range(o.candidates)]
    else:  # catalog items, scored by their semantic-ID codes
        ids = torch.randperm(len(engine.catalog), generator=generator)[: o.candidates].tolist()
        cands = [Candidate(item_id=engine.catalog.item_ids[i]) for i in ids]
    request = ScoreRequest(prompt_token_ids=prompt, candidates=cands)
    tokens_per_candidate = o.candidate_len or len(engine.catalog.codes[0])
    total_tokens = o.prefix_len + o.candidates * tokens_per_candidate
    plain = torch.tensor(random_prompt(engine, total_tokens, generator), device=o.device)

    def plain_forward():
        ctx = ContextKV.allocate(engine.model.config, total_tokens, o.device, engine.model.dtype)
        engine.model.prefill(engine.model.embed(plain), ctx)

    calls = {"genrec": lambda: engine.score([request]), "plain": plain_forward}
    seconds = interleaved_medians(calls, o.repeats, o.device)
    genrec_s, plain_s = seconds["genrec"], seconds["plain"]
    fanout_s, sampled = _fanout(engine, model_dir, request, o.device, o.fanout_sample)
    report = {
        "benchmark": "score",
        **described(model_dir, o, "device"),
        "dtype": str(engine.model.dtype),
        "prefix_len": o.prefix_len,
        "candidates": o.candidates,
        "tokens_per_candidate": tokens_per_candidate,
        "repeats": o.repeats,
        "seconds": {"genrec_one_pass": genrec_s, "hf_fanout": fanout_s, "plain_forward_same_tokens": plain_s},
        "fanout_measured_candidates": sampled,
        "ratios": {"fanout_over_genrec": fanout_s / genrec_s, "genrec_over_plain_forward": genrec_s / plain_s},
        "machine": machine(),
    }
    if o.peer:
        report[o.peer] = peer_vllm.compare_score(engine, model_dir, request, o.device, o.repeats)
    return report


@torch.inference_mode()
def _fanout(engine, model_dir, request, device, sample):
    """One transformers forward (prefix + candidate) per candidate. Every such forward costs the same, so
    timing `sample` of them and scaling to all candidates is exact up to noise."""
    hf = load_hf(model_dir, device, engine.model.dtype)
    prompt = request.prompt_token_ids
    token_lists = [
        engine.catalog.codes[engine.catalog.index_of(c.item_id)].tolist() if c.item_id else c.token_ids
        for c in request.candidates
    ]
    chosen = token_lists[: min(sample, len(token_lists))]
    hf(torch.tensor([prompt + chosen[0]], device=device))  # warm-up

    def forwards():
        for tokens in chosen:
            hf(torch.tensor([prompt + tokens], device=device)).logits[0, -1].float().log_softmax(-1)

    return timed(forwards, device) / len(chosen) * len(token_lists), len(chosen)


def rank(o: RankOptions) -> dict:
    path = o.model or hstu_preset_dir(o.preset)
    engine = Engine.from_pretrained(path, device=o.device, scheduler=COLD)
    request = rank_request(engine, o.events, o.candidates)
    singles = [request.model_copy(update={"candidates": [c]}) for c in request.candidates[: o.fanout_sample]]
    calls = {
        "genrec_one_pass": lambda: engine.rank([request]),
        "one_request_per_candidate_sample": lambda: [engine.rank([s]) for s in singles],
        "plain_masked_forward": lambda: plain_masked_forward(engine, request),
    }
    seconds = interleaved_medians(calls, o.repeats, o.device)
    fanout_s = seconds.pop("one_request_per_candidate_sample") * o.candidates / len(singles)
    seconds["one_request_per_candidate"] = fanout_s
    one = seconds["genrec_one_pass"]
    warm = warm_and_cold(engine, request, o.new_events, o.repeats, o.device)
    return {
        "benchmark": "rank",
        **described(path, o, "device"),
        "history_events": o.events,
        "candidates": o.candidates,
        "fanout_timed": len(singles),
        "repeats": o.repeats,
        "seconds": seconds,
        "returning": warm,
        "ratios": {
            "one_request_per_candidate_over_one_pass": fanout_s / one,
            "one_pass_over_plain_masked_forward": one / seconds["plain_masked_forward"],
            "cold_over_warm": warm["cold_over_warm"],
        },
        "machine": machine(),
    }


def rank_request(engine: Engine, events: int, candidates: int, seed: int = 0) -> RankRequest:
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
    """The whole [history + candidates] sequence in one forward with the dense ranking mask: the baseline. Its
    indices and mask are built on the host, then moved to the model's device (each at once)."""
    model, prepared = engine.model, engine.prepare(request)
    T, C = len(prepared.token_ids), len(prepared.candidate_rows)
    events = prepared.token_ids
    items = torch.cat([events[:, 0], torch.as_tensor(prepared.candidate_rows)])
    actions = torch.cat([events[:, 1], torch.full((C,), model.config.no_action)])
    buckets = torch.cat([events[:, 2], torch.full((C,), model.config.unknown_bucket)])
    positions = torch.cat([torch.arange(T), torch.full((C,), T)])
    mask = torch.ones(T + C, T + C, dtype=torch.bool).tril()
    mask[T:, T:] = torch.eye(C, dtype=torch.bool)
    items, actions, buckets, positions, mask = (t.to(model.device) for t in (items, actions, buckets, positions, mask))
    x = model.embed_events(items, actions, positions, buckets if model.config.num_time_buckets else None)
    for layer in model.layers:
        u, v, q, k = layer.project(x)
        scores = F.silu(torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)) * model.scale) * mask
        attn = torch.matmul(scores, v.transpose(0, 1)).transpose(0, 1)
        x = layer.finish(x, u, attn * model.inv_normalizer)
    return model.task_probs(x[T:])


def warm_and_cold(
    engine: Engine, request: RankRequest, new_events: int, repeats: int, device: str, every_piece: bool = False
) -> dict:
    """A returning user: the history cached, `new_events` more each visit; the same requests with no cache. The
    scheduler is stepped directly so that only the engine's work is timed (each request prepared beforehand).
    `every_piece`: also warm with the cost rule off (every cached piece read, genrec.engine.prefix_cache)."""
    out = {}
    modes = [("cold", 0, True), ("warm", None, True)] + [("warm_every_piece", None, False)] * every_piece
    for name, cache, rule in modes:
        config = SchedulerConfig(prefix_cache_bytes=cache, request_timeout_s=600)
        scheduler = Scheduler(engine.family, engine.runner, config, model_version=engine.model_version)
        scheduler.cache.gain = scheduler.cache.gain if rule else None
        history, times = list(request.history), []
        for visit in range(repeats + 1):
            last = history[-1].timestamp
            history = history + [
                Event(item_id=e.item_id, timestamp=last + 60.0 * (j + 1)) for j, e in enumerate(history[:new_events])
            ]
            returning = {"history": history, "cache_scope": "user-0"}  # one user's scope: their history reused
            prepared = engine.prepare(request.model_copy(update=returning))
            seconds = timed(functools.partial(_drain, scheduler, prepared), device)
            if visit:  # the first visit fills the cache
                times.append(seconds)
        out[f"{name}_s"] = statistics.median(times)
        out[f"{name}_events_reused"] = scheduler.cache.stats.tokens_reused
    out["cold_over_warm"] = out["cold_s"] / out["warm_s"]
    return out


def _drain(scheduler: Scheduler, prepared) -> None:
    scheduler.submit(prepared)
    while not scheduler.idle:
        scheduler.step()
