"""Our decoder's forward pass against transformers (the numerical reference), on each architecture: Qwen3 against
Qwen3ForCausalLM, Qwen2 (q/k/v biases, no q/k norm) against Qwen2ForCausalLM."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from genrec.attention import ContextGroup, ContextRows
from genrec.model.directory import ModelDir
from genrec.model.qwen3 import ContextKV
from genrec.testing.tiny import ModelSpec, write_model_dir

TOL = 1e-4


@pytest.fixture(scope="module")
def ours(arch_dir):
    return ModelDir.open(arch_dir).load_model()


def full_prefill(model, ids):
    ctx = ContextKV.allocate(model.config, len(ids), "cpu", torch.float32)
    logits = model.prefill(model.embed(ids), ctx, logits_at=torch.arange(len(ids)))
    return logits, ctx


@pytest.mark.parametrize("length", [1, 5, 33, 200])
def test_prefill_logits_equal_transformers(ours, arch_hf_model, rng, length):
    ids = torch.randint(0, ours.config.vocab_size, (length,), generator=rng)
    with torch.no_grad():
        ref = arch_hf_model(ids[None]).logits[0]
    logits, ctx = full_prefill(ours, ids)
    assert ctx.length == length
    assert (logits - ref).abs().max().item() <= TOL


def test_chunked_prefill_equals_one_pass(ours, arch_hf_model, rng):
    ids = torch.randint(0, ours.config.vocab_size, (90,), generator=rng)
    with torch.no_grad():
        ref = arch_hf_model(ids[None]).logits[0]
    ctx = ContextKV.allocate(ours.config, 90, "cpu", torch.float32)
    parts = [ours.prefill(ours.embed(chunk), ctx, torch.arange(len(chunk))) for chunk in ids.split([40, 1, 49])]
    assert (torch.cat(parts) - ref).abs().max().item() <= TOL


def test_rows_over_shared_context_equal_transformers(ours, arch_hf_model, rng):
    """Rows of 1..4 new tokens over one shared prompt: each equals prompt+row run alone in transformers."""
    prompt = torch.randint(0, ours.config.vocab_size, (25,), generator=rng)
    _, ctx = full_prefill(ours, prompt)
    rows = torch.randint(0, ours.config.vocab_size, (6, 4), generator=rng)
    positions = torch.arange(25, 29).expand(6, 4)
    hidden, new_k, _ = ours.forward_rows(ours.embed(rows), positions, ContextRows([ContextGroup(0, 6, ctx)], 6, 4))
    logits = ours.logits(hidden)
    assert new_k.shape == (ours.config.num_hidden_layers, 6, 4, ours.config.num_key_value_heads, ours.config.head_dim)
    with torch.no_grad():
        ref = arch_hf_model(torch.cat([prompt.expand(6, 25), rows], dim=1)).logits[:, 25:]
    assert (logits - ref).abs().max().item() <= TOL


def test_rows_with_past_suffix_equal_transformers(ours, arch_hf_model, rng):
    """A row whose first tokens come as past K/V (like a beam's ancestors) equals the plain sequence."""
    prompt = torch.randint(0, ours.config.vocab_size, (12,), generator=rng)
    _, ctx = full_prefill(ours, prompt)
    rows = torch.randint(0, ours.config.vocab_size, (3, 3), generator=rng)
    groups = [ContextGroup(0, 3, ctx)]
    _, k1, v1 = ours.forward_rows(ours.embed(rows[:, :2]), torch.arange(12, 14).expand(3, 2), ContextRows(groups, 3, 2))
    past = (k1.flatten(1, 2), v1.flatten(1, 2), torch.arange(6).view(3, 2))  # read where they lie, as a pool's
    hidden, _, _ = ours.forward_rows(ours.embed(rows[:, 2:]), torch.full((3, 1), 14), ContextRows(groups, 3), past)
    with torch.no_grad():
        ref = arch_hf_model(torch.cat([prompt.expand(3, 12), rows], dim=1)).logits[:, -1]
    assert (ours.logits(hidden[:, -1]) - ref).abs().max().item() <= TOL


def test_tied_embeddings_and_sharded_weights(tmp_path, rng, architecture):
    from transformers import AutoModelForCausalLM

    spec = ModelSpec(items=50, levels=2, codebook=8, tie_word_embeddings=True, architecture=architecture)
    model_dir = write_model_dir(tmp_path / "tied", spec)
    tensors = load_file(str(model_dir / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(model_dir / shard))
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    (model_dir / "model.safetensors").unlink()

    ours = ModelDir.open(model_dir).load_model()
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.vocab_size, (17,), generator=rng)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (full_prefill(ours, ids)[0] - ref).abs().max().item() <= TOL


def test_bfloat16_runs_on_the_same_code(arch_dir, ours, rng):
    half = ModelDir.open(arch_dir).load_model(dtype=torch.bfloat16)
    ids = torch.randint(0, half.config.vocab_size, (20,), generator=rng)
    ctx = ContextKV.allocate(half.config, 20, "cpu", torch.bfloat16)
    logits = half.prefill(half.embed(ids), ctx)
    ref = full_prefill(ours, ids)[0][-1:]
    assert logits.dtype == torch.float32
    assert torch.allclose(logits, ref, atol=0.5), "bf16 logits drift far from float32"


def test_packed_prefill_equals_separate_prefills(ours, arch_hf_model, rng):
    """Prompts and prompt chunks packed into one pass give each prompt's own logits and K/V."""
    prompts = [torch.randint(0, ours.config.vocab_size, (n,), generator=rng) for n in (9, 1, 30)]
    ctxs = [ContextKV.allocate(ours.config, len(p), "cpu", torch.float32) for p in prompts]
    ours.prefill(ours.embed(prompts[2][:12]), ctxs[2])  # the third is mid-way through a chunked prefill
    segments = [
        (ours.embed(prompts[0]), ctxs[0]),
        (ours.embed(prompts[1]), ctxs[1]),
        (ours.embed(prompts[2][12:]), ctxs[2]),
    ]
    logits = ours.prefill_packed(segments)
    for prompt, ctx, row in zip(prompts, ctxs, logits, strict=True):
        with torch.no_grad():
            ref = arch_hf_model(prompt[None]).logits[0, -1]
        assert ctx.length == len(prompt)
        assert (row - ref).abs().max().item() <= TOL
        _, alone = full_prefill(ours, prompt)
        assert torch.allclose(ctx.k, alone.k, atol=1e-5) and torch.allclose(ctx.v, alone.v, atol=1e-5)
