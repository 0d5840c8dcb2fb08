"""Plain reference computations with transformers, for equality tests."""

from dataclasses import dataclass

import torch

from genrec.attention import context_attention
from genrec_bench.reference import allowed_tokens_fn


@torch.no_grad()
def teacher_forced_logprobs(hf_model, prompt: list[int], codes, inputs_embeds=None, chunk=128) -> torch.Tensor:
    """Sum over levels of the full-vocabulary log-softmax of each code after the prompt: [len(codes)]."""
    codes = torch.as_tensor(codes)
    T, D = len(prompt), codes.shape[1]
    out = []
    for part in codes.split(chunk):
        ids = torch.cat([torch.tensor(prompt).expand(len(part), T), part], dim=1)
        if inputs_embeds is None:
            logits = hf_model(ids).logits
        else:
            code_embeds = hf_model.get_input_embeddings()(part)
            embeds = torch.cat([inputs_embeds.expand(len(part), T, -1), code_embeds], dim=1)
            logits = hf_model(inputs_embeds=embeds).logits
        logp = torch.log_softmax(logits[:, T - 1 : T - 1 + D].float(), dim=-1)
        out.append(logp.gather(2, part[:, :, None])[..., 0].sum(1))
    return torch.cat(out)


@torch.no_grad()
def hf_constrained_beams(hf_model, prompt: list[int], codes, beam_width: int, pad_token_id: int):
    """transformers' own beam search, constrained by prefix_allowed_tokens_fn: (codes, scores) best first."""
    allowed = allowed_tokens_fn(codes)
    ids = torch.tensor([prompt])
    n = ids.shape[1]
    D = codes.shape[1]
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        num_beams=beam_width,
        num_return_sequences=beam_width,
        max_new_tokens=D,
        min_new_tokens=D,
        do_sample=False,
        length_penalty=0.0,
        early_stopping=True,
        prefix_allowed_tokens_fn=lambda _b, seq: allowed(seq[n:].tolist()),
        pad_token_id=pad_token_id,
        eos_token_id=None,
        output_scores=True,
        return_dict_in_generate=True,
    )
    found = out.sequences[:, n:].tolist()
    # Greedy search (one beam) reports no sequence scores: score its codes by teacher forcing.
    scores = getattr(out, "sequences_scores", None)
    if scores is None:
        scores = teacher_forced_logprobs(hf_model, prompt, found)
    return found, scores.tolist()


@dataclass(frozen=True)
class LayerContext:
    """Rows [start, stop) attend to k, v: [kv_heads, T, head_dim] (one layer of one request's context)."""

    start: int
    stop: int
    k: torch.Tensor
    v: torch.Tensor


class GroupedContext:
    """The context part of shared-context attention done plainly: one attention call per group of rows, over
    that group's own K/V tensors (what the pooled varlen call replaces). Rows outside every group, and groups
    over an empty context, take nothing from the context."""

    def __init__(self, groups: list[LayerContext], per_row: int = 1):
        self.groups, self.per_row = groups, per_row

    def attend(self, q: torch.Tensor, scale: float):
        M, H, D = q.shape
        out = q.new_zeros(M, H, D)
        lse = torch.full((H, M), float("-inf"))
        for g in self.groups:
            lo, hi = g.start * self.per_row, g.stop * self.per_row
            if hi == lo or g.k.shape[1] == 0:
                continue
            KV = g.k.shape[0]
            qb = q[lo:hi].view(hi - lo, KV, H // KV, D).permute(1, 0, 2, 3).reshape(KV, -1, D)
            o, s = context_attention(qb, g.k, g.v, scale)
            out[lo:hi] = o.view(KV, hi - lo, H // KV, D).permute(1, 0, 2, 3).reshape(hi - lo, H, D)
            lse[:, lo:hi] = s.view(KV, hi - lo, H // KV).permute(0, 2, 1).reshape(H, hi - lo)
        return out, lse


def layer_groups(groups, layer: int) -> list[LayerContext]:
    """ContextGroups over pooled ContextKVs as plain per-layer tensors."""
    return [LayerContext(g.start, g.stop, *g.ctx.layer(layer)) for g in groups]


@torch.no_grad()
def sequence_logprobs(hf_model, prompt: list[int], sequences: list[list[int]]) -> list[float]:
    """log P(sequence | prompt) of each token sequence (any lengths), one plain forward per sequence."""
    out = []
    for seq in sequences:
        logits = hf_model(torch.tensor([prompt + list(seq)])).logits[0].float()
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        out.append(logp.gather(1, torch.tensor(seq)[:, None]).sum().item())
    return out


def exhaustive_retrieval(catalog, ending, hf_model, prompt: list[int], excluded=(), popularity=None):
    """Every code scored by `sequence_logprobs` (code + ending after the prompt), best first, each with its items
    not excluded (popularity descending, ties in catalog order): [(code, logprob, [item_id, ...])]."""
    by_code: dict[tuple, list[int]] = {}
    for i in range(len(catalog)):
        by_code.setdefault(tuple(catalog.code(i)), []).append(i)
    excluded = set(excluded)
    codes = [code for code, rows in by_code.items() if any(catalog.item_ids[r] not in excluded for r in rows)]
    scores = sequence_logprobs(hf_model, prompt, [[*code, *ending] for code in codes])
    ranked = []
    for code, score in sorted(zip(codes, scores, strict=True), key=lambda pair: -pair[1]):
        rows = sorted(by_code[code], key=lambda r: (-(popularity[r] if popularity is not None else 0), r))
        ranked.append((list(code), score, [catalog.item_ids[r] for r in rows if catalog.item_ids[r] not in excluded]))
    return ranked


def scheduled_beam_search(hf_model, prompt: list[int], sequences, widths: list[int]) -> list[tuple[tuple, float]]:
    """A textbook beam search over token sequences (any lengths), by plain forwards: at step l every kept prefix is
    extended by each next token some sequence allows (a finished sequence stays as it is, at its score), and the
    best widths[l] prefixes by log P(prefix | prompt) are kept. The kept sequences after the last step, best first,
    with their scores: [(sequence, logprob)]."""
    sequences = [tuple(s) for s in sequences]
    kept = [((), 0.0)]
    for step, width in enumerate(widths):
        alive = {prefix for prefix, _ in kept}
        options = sorted({s[: step + 1] for s in sequences if s[:step] in alive})
        scores = sequence_logprobs(hf_model, prompt, [list(p) for p in options])
        kept = sorted(zip(options, scores, strict=True), key=lambda pair: pair[1], reverse=True)[:width]
    return kept
