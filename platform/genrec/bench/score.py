"""`genrec bench score`: one-pass scoring vs one forward per candidate vs one plain forward of as many tokens."""

from __future__ import annotations

import torch

from genrec.api import Candidate, ScoreRequest
from genrec.bench import peer_vllm
from genrec.bench.common import interleaved_medians, load_hf, machine, model_dir_for, random_prompt, synchronize
from genrec.engine import Engine, SchedulerConfig
from genrec.model import ContextKV

COLD = SchedulerConfig(prefix_cache_bytes=0)


def run(
    prefix_len, candidates, candidate_len, preset, model, device, repeats, fanout_sample, peer=None, cuda_fast=False
) -> dict:
    model_dir = model_dir_for(preset, model, None)
    engine = Engine.from_pretrained(
        model_dir, device=device, max_candidates=max(candidates, 2048), cuda_fast=cuda_fast, scheduler=COLD
    )  # the same prompt every round: no prefix cache, or it would be warm
    if peer:
        peer_vllm.check(peer, engine.model.config, device)
    generator = torch.Generator().manual_seed(0)
    prompt = random_prompt(engine, prefix_len, generator)
    if candidate_len:
        cands = [Candidate(token_ids=random_prompt(engine, candidate_len, generator)) for _ in range(candidates)]
    else:  # catalog items, scored by their semantic-ID codes
        ids = torch.randperm(len(engine.catalog), generator=generator)[:candidates].tolist()
        cands = [Candidate(item_id=engine.catalog.item_ids[i]) for i in ids]
    request = ScoreRequest(prompt_token_ids=prompt, candidates=cands)
    tokens_per_candidate = len(engine.catalog.codes[0]) if not candidate_len else candidate_len
    total_tokens = prefix_len + candidates * tokens_per_candidate

    plain = torch.tensor(random_prompt(engine, total_tokens, generator), device=device)

    def plain_forward():
        ctx = ContextKV.allocate(engine.model.config, total_tokens, device, engine.model.dtype)
        engine.model.prefill(engine.model.embed(plain), ctx)

    seconds = interleaved_medians({"genrec": lambda: engine.score([request]), "plain": plain_forward}, repeats, device)
    genrec_s, plain_s = seconds["genrec"], seconds["plain"]
    fanout_s, sampled = _fanout(engine, model_dir, request, device, fanout_sample)
    report = {
        "benchmark": "score",
        "model": str(model_dir),
        "preset": None if model else preset,
        "device": device,
        "dtype": str(engine.model.dtype),
        "prefix_len": prefix_len,
        "candidates": candidates,
        "tokens_per_candidate": tokens_per_candidate,
        "repeats": repeats,
        "seconds": {"genrec_one_pass": genrec_s, "hf_fanout": fanout_s, "plain_forward_same_tokens": plain_s},
        "fanout_measured_candidates": sampled,
        "ratios": {"fanout_over_genrec": fanout_s / genrec_s, "genrec_over_plain_forward": genrec_s / plain_s},
        "machine": machine(),
    }
    if peer:
        report[peer] = peer_vllm.compare_score(engine, model_dir, request, device, repeats)
    return report


@torch.inference_mode()
def _fanout(engine, model_dir, request, device, sample):
    """One transformers forward (prefix + candidate) per candidate. Every such forward costs the same, so
    timing `sample` of them and scaling to all candidates is exact up to noise."""
    import time

    hf = load_hf(model_dir, device, engine.model.dtype)
    prompt = request.prompt_token_ids
    token_lists = [
        engine.catalog.codes[engine.catalog.index_of(c.item_id)].tolist() if c.item_id else c.token_ids
        for c in request.candidates
    ]
    chosen = token_lists[: min(sample, len(token_lists))]
    hf(torch.tensor([prompt + chosen[0]], device=device))  # warm-up
    synchronize(device)
    start = time.perf_counter()
    for tokens in chosen:
        hf(torch.tensor([prompt + tokens], device=device)).logits[0, -1].float().log_softmax(-1)
    synchronize(device)
    per_candidate = (time.perf_counter() - start) / len(chosen)
    return per_candidate * len(token_lists), len(chosen)
