"""`genrec bench retrieve`: Engine.retrieve vs one plain prefill (the floor) vs transformers beam search."""

from __future__ import annotations

from pathlib import Path

import torch

from genrec.api import RetrieveRequest
from genrec.bench import peer_vllm
from genrec.bench.common import interleaved_medians, load_hf, machine, median_seconds, model_dir_for, random_prompt
from genrec.catalog.reference import allowed_tokens_fn
from genrec.engine import Engine, SchedulerConfig

COLD = SchedulerConfig(prefix_cache_bytes=0)


def run(
    prompt_len,
    beam_width,
    preset,
    model,
    levels,
    batch,
    device,
    repeats,
    hf_baseline,
    user_embedding=False,
    peer=None,
    cuda_fast=False,
):
    model_dir = model_dir_for(preset, model, levels)
    # Every round repeats the same prompts: with the prefix cache on they would be warm, not a retrieve's cost.
    engine = Engine.from_pretrained(model_dir, device=device, cuda_fast=cuda_fast, scheduler=COLD)
    if peer:
        peer_vllm.check(peer, engine.model.config, device, beam_width)
    generator = torch.Generator().manual_seed(0)
    requests = [
        RetrieveRequest(prompt_token_ids=random_prompt(engine, prompt_len, generator), beam_width=beam_width)
        for _ in range(batch)
    ]
    prepared = [engine.prepare(r) for r in requests]
    timed = {
        "prefill_floor": lambda: [engine.runner.prefill_alone(p) for p in prepared],
        "genrec_retrieve": lambda: engine.retrieve(requests),
    }
    if user_embedding:
        soft = _soft_token_requests(engine, requests)
        timed["genrec_retrieve_soft_token"] = lambda: engine.retrieve(soft)
    seconds = interleaved_medians(timed, repeats, device)
    prefill_s, retrieve_s = seconds["prefill_floor"], seconds["genrec_retrieve"]
    report = {
        "benchmark": "retrieve",
        "model": str(model_dir),
        "preset": None if model else preset,
        "device": device,
        "dtype": str(engine.model.dtype),
        "prompt_len": prompt_len,
        "beam_width": beam_width,
        "levels": engine.catalog.levels,
        "items": len(engine.catalog),
        "batch": batch,
        "repeats": repeats,
        "seconds": seconds,
        "ratios": {"retrieve_over_prefill": retrieve_s / prefill_s},
        "machine": machine(),
    }
    if user_embedding:
        report["ratios"]["soft_token_over_token_only"] = seconds["genrec_retrieve_soft_token"] / retrieve_s
    if hf_baseline:
        hf_s, agreement = _hf_generate(engine, model_dir, requests, device, max(1, min(repeats, 2)))
        report["seconds"]["hf_generate"] = hf_s
        report["ratios"]["hf_over_retrieve"] = hf_s / retrieve_s
        report["hf_top_beam_agreement"] = agreement
    if peer:
        report[peer] = peer_vllm.compare_retrieve(engine, model_dir, requests, device, repeats)
    return report


def _soft_token_requests(engine, requests):
    """The same requests with a `<|user|>` placeholder carrying a user vector in place of their first token."""
    if engine.family.projector is None:
        raise ValueError("--user-embedding needs a model with genrec/soft_token.safetensors")
    generator = torch.Generator().manual_seed(1)
    soft = [
        req.model_copy(
            update={
                "prompt_token_ids": [engine.family.placeholder_id] + req.prompt_token_ids[1:],
                "user_embedding": torch.randn(engine.family.projector.user_dim, generator=generator).tolist(),
            }
        )
        for req in requests
    ]
    return soft


def _hf_generate(engine, model_dir: Path, requests, device, repeats):
    hf = load_hf(model_dir, device, engine.model.dtype)
    allowed = allowed_tokens_fn(engine.catalog.codes)

    def generate_all():
        outputs = []
        for req in requests:
            ids = torch.tensor([req.prompt_token_ids], device=device)
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                num_beams=req.beam_width,
                num_return_sequences=req.beam_width,
                max_new_tokens=engine.catalog.levels,
                min_new_tokens=engine.catalog.levels,
                do_sample=False,
                length_penalty=0.0,
                early_stopping=True,
                prefix_allowed_tokens_fn=lambda _b, seq, n=ids.shape[1]: allowed(seq[n:].tolist()),
                pad_token_id=engine.family.tokenizer.pad_token_id,
                eos_token_id=None,
            )
            outputs.append(out[:, ids.shape[1] :].tolist())
        return outputs

    seconds = median_seconds(generate_all, repeats, device, warmup=0)
    ours = engine.retrieve(requests)
    hf_codes = generate_all()
    matches = [
        float(mine.items[0].semantic_id == theirs[0]) if mine.items else 0.0
        for mine, theirs in zip(ours, hf_codes, strict=True)
    ]
    return seconds, sum(matches) / len(matches)
