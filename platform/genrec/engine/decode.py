"""One decode pass for the rows of several beam cohorts at once (one pass through the MLPs).

Cohorts may stand at different code levels, so their beams carry suffixes of different lengths; the
past suffix K/V is padded to the longest and masked.
"""

from __future__ import annotations

from itertools import groupby

import torch

from genrec.attention import ContextGroup
from genrec.engine.beam import BeamCohort, select_together
from genrec.engine.decode_graph import DecodeRunner
from genrec.model.qwen3 import Qwen3


def decode_step(model: Qwen3, cohorts: list[BeamCohort], runner: DecodeRunner | None = None) -> None:
    """One pass for every row of the cohorts, then each cohort's selection. With a `runner` whose pool holds
    the cohorts' KV, the pass has static shapes (a CUDA graph on the GPU); else it is built to fit."""
    cohorts = sorted(cohorts, key=lambda c: c.level)  # same-level cohorts adjacent: one selection each
    if runner is not None and runner.accepts(cohorts):
        logprobs, new_k, new_v = runner.run(cohorts)
    else:
        logprobs, new_k, new_v = _eager_pass(model, cohorts)
    start = 0
    for _, same_level in groupby(cohorts, key=lambda c: c.level):
        group = list(same_level)
        stop = start
        for cohort in group:
            cohort.record_kv(new_k[:, stop : stop + cohort.rows], new_v[:, stop : stop + cohort.rows])
            stop += cohort.rows
        select_together(group, logprobs[start:stop])
        start = stop


def _eager_pass(model: Qwen3, cohorts: list[BeamCohort]):
    inputs = [c.decode_inputs() for c in cohorts]
    if len(cohorts) == 1:
        tokens, positions, groups, past_k, past_v = inputs[0]
        mask = None
    else:
        tokens, positions, groups, past_k, past_v, mask = _merge(inputs, model)
    hidden, new_k, new_v = model.forward_rows(model.embed(tokens), positions, groups, past_k, past_v, mask=mask)
    return torch.log_softmax(model.logits(hidden[:, -1]), dim=-1), new_k, new_v


def _merge(inputs, model: Qwen3):
    c = model.config
    rows = [x[0].shape[0] for x in inputs]
    pasts = [0 if x[3] is None else x[3].shape[2] for x in inputs]
    longest = max(pasts)
    device = inputs[0][0].device
    tokens = torch.cat([x[0] for x in inputs])
    positions = torch.cat([x[1] for x in inputs])
    groups, offset = [], 0
    for (_, _, cohort_groups, _, _), n in zip(inputs, rows, strict=True):
        groups += [ContextGroup(g.start + offset, g.stop + offset, g.ctx) for g in cohort_groups]
        offset += n
    past_k = past_v = None
    # Keys of a row: [padded past (longest) ; its new token]. Padding is masked out.
    mask = torch.ones(sum(rows), 1, longest + 1, dtype=torch.bool, device=device)
    if longest:
        shape = (c.num_hidden_layers, sum(rows), longest, c.num_key_value_heads, c.head_dim)
        past_k = torch.zeros(shape, dtype=model.dtype, device=device)
        past_v = torch.zeros(shape, dtype=model.dtype, device=device)
        offset = 0
        for (_, _, _, k, v), n, p in zip(inputs, rows, pasts, strict=True):
            if p:
                past_k[:, offset : offset + n, :p] = k
                past_v[:, offset : offset + n, :p] = v
            mask[offset : offset + n, :, p:longest] = False
            offset += n
    return tokens, positions, groups, past_k, past_v, mask
