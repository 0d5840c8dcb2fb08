"""Tiny OpenOneRec- and MiniOneRec-layout checkpoints for the tests of issue #30 (layouts, importers, engine
equality, Serve and batch); conftest.py's `openonerec` and `minionerec` fixtures write them once per session."""

import shutil

import torch

from genrec.testing.open_layouts import OpenLayoutSpec

OPEN_SPEC = OpenLayoutSpec(items=120, codebook=16, shared=12, seed=3)


def fresh_copy(checkpoint, tmp_path):
    """A copy of a written checkpoint's directory a test may change (its item map inside it)."""
    target = tmp_path / checkpoint.model_dir.name
    shutil.copytree(checkpoint.model_dir, target)
    return target, target / checkpoint.item_map.name


def prefix_table(sequences):
    """prefix (tuple of token IDs) -> allowed next tokens, over whole sequences (codes with their endings)."""
    table: dict[tuple, set] = {}
    for seq in sequences:
        for i in range(len(seq)):
            table.setdefault(tuple(seq[:i]), set()).add(seq[i])
    return {prefix: sorted(tokens) for prefix, tokens in table.items()}


@torch.no_grad()
def hf_constrained_beams(hf_model, prompt, sequences, beam_width, eos=None):
    """transformers' own beam search over the catalog's sequences (code + ending), no length normalisation:
    [(sequence, score)] best first, a sequence cut after its EOS."""
    table = prefix_table(sequences)
    ids = torch.tensor([prompt])
    n = ids.shape[1]
    longest = max(len(s) for s in sequences)
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        num_beams=beam_width,
        num_return_sequences=beam_width,
        max_new_tokens=longest,
        do_sample=False,
        length_penalty=0.0,
        early_stopping=True,
        # a sequence past its EOS (transformers still asks for the beams it keeps running) may only pad
        prefix_allowed_tokens_fn=lambda _b, seq: table.get(tuple(seq[n:].tolist()), [eos]),
        pad_token_id=eos if eos is not None else 0,
        eos_token_id=eos,
        output_scores=True,
        return_dict_in_generate=True,
    )
    found = []
    for seq in out.sequences[:, n:].tolist():
        found.append(seq[: seq.index(eos) + 1] if eos is not None and eos in seq else seq)
    return list(zip(found, out.sequences_scores.tolist(), strict=True))


@torch.no_grad()
def hf_sequence_logprobs(hf_model, prompt, sequences):
    """Sum of the full-vocabulary log-softmax of each sequence's tokens after the prompt (one forward each)."""
    out = []
    for seq in sequences:
        logits = hf_model(torch.tensor([prompt + list(seq)])).logits[0, len(prompt) - 1 : -1]
        out.append(torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(seq)[:, None]).sum().item())
    return out
