"""Constrained wide beam search over the catalog trie, for a cohort of requests that step together
(docs/design.md, 'Shared-context attention' for BeamKV/BeamPath; 'Constrained decoding over a flat trie'): the
cohorts' rows and paths; what each step chooses is genrec.engine.selection's.

BeamKV: pass p's rows write slots base[p] + row, never reordered; BeamPath (`ancestors`): [rows, passes] slot
indices. Everything is a tensor op over all rows of all requests: no loop over beams, no host sync until
`results()`. A request's schedule keeps schedule[l] rows after step l; steps past it (ending tokens) keep the last
width. A filtered request ANDs its per-step node mask into its rows' children: one gather per filtered request.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from genrec.catalog.trie import CodeTrie
from genrec.engine.row_layout import row_layout
from genrec.engine.selection import apply_moves, choices, rows_after, select_together
from genrec.model.fused import column_logprobs
from genrec.model.kv_pool import ContextKV, Extent
from genrec.staging import fetch, to_device

NEG_INF = float("-inf")


Width = int | Sequence[int]  # one width for every step, or one per code level (see the module's docstring)


def step_widths(trie: CodeTrie, width: Width) -> tuple[int, ...]:
    """The width of each decode step of `trie`: a schedule shorter than the steps keeps its last width after."""
    widths = (width,) if isinstance(width, int) else tuple(width)
    if len(widths) > trie.levels:
        raise ValueError(f"a schedule of {len(widths)} widths for {trie.levels} decode steps")
    return widths + widths[-1:] * (trie.levels - len(widths))


def request_width(request) -> Width:
    return request.beam_widths if getattr(request, "beam_widths", None) else request.beam_width


class BeamCohort:
    def __init__(
        self,
        trie: CodeTrie,
        widths: list[Width],
        contexts: list[ContextKV],
        exclusions: list[np.ndarray],
        slots: Extent,
        filters: list | None = None,
    ):
        """`slots`: an extent of the contexts' own KV pool for the BeamKV (`slots_needed` tokens), so a decode pass
        reads suffix and context from one pool. `filters`: per request a `FilterMask` or None."""
        widths = [step_widths(trie, w) for w in widths]
        self.trie, self.widths, self.contexts = trie, widths, contexts
        self.device = device = slots.pool.k.device
        n = len(widths)
        self.base = _pass_bases(trie, widths)
        self.slot_pool, self.slot_offset = slots.pool, slots.start
        self.level = 0
        self.prompt_lens = to_device([c.length for c in contexts], device)
        # Rows before the first selection: one per request (its prefill's last position).
        self.scores = torch.zeros(n, device=device)
        self.nodes = torch.zeros(n, dtype=torch.int64, device=device)
        self.rows_per_req = [1] * n
        self.ancestors = torch.zeros(n, 0, dtype=torch.int64, device=device)  # BeamPath: [rows, passes] slots
        self.tokens: list[torch.Tensor] = []  # per level, the token each selected row chose
        self.filters = filters if filters is not None else [None] * n
        self._excluded = _excluded_node_keys(trie, exclusions, device, self.filters)

    @property
    def done(self) -> bool:
        return self.level == self.trie.levels

    @property
    def rows(self) -> int:
        return sum(self.rows_per_req)

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next decode pass's (tokens [R], positions [R]): pass `level` feeds the level-(level-1) tokens."""
        row_req = row_layout(tuple(self.rows_per_req), self.device)["row_req"]
        return self.tokens[-1], self.prompt_lens[row_req] + self.level - 1

    def advance(self, parent: torch.Tensor, tokens: torch.Tensor, nodes, scores, rows_per_req: list[int]) -> None:
        """Take the next level's rows: parent [new rows] (rows of this level), their tokens, nodes and scores."""
        if self.level:  # a row's ancestors: its parent's, then the parent's own slot of the pass just run
            own = (parent + self.base[self.level - 1])[:, None]
            self.ancestors = torch.cat((self.ancestors[parent], own), dim=1)
        else:
            self.ancestors = self.ancestors.new_zeros(len(parent), 0)
        self.rows_per_req = rows_per_req
        self.tokens.append(tokens)
        self.nodes, self.scores = nodes, scores
        self.level += 1

    def results(self, host: tuple[list[float], list[int]] | None = None) -> list[list[tuple[int, float]]]:
        """Per request, (code, logprob) best first; `host`: this cohort's part of `fetch_finals`."""
        scores, items = host if host is not None else fetch_finals([self])[0]
        out = []
        for off, n in zip(self._offsets(), self.rows_per_req, strict=True):
            out.append([(items[i], scores[i]) for i in range(off, off + n) if scores[i] != NEG_INF])
        return out

    def _offsets(self) -> list[int]:
        return [sum(self.rows_per_req[:r]) for r in range(len(self.rows_per_req))]


def start_cohort(trie: CodeTrie, prepared: list, contexts: list[ContextKV], last_logits: torch.Tensor, slots: Extent):
    """A cohort of `Prepared`s over their prefilled contexts, its first level chosen from last_logits [n, vocab]."""
    exclusions = [np.asarray(p.exclusions, dtype=np.int64) for p in prepared]
    widths = [request_width(p.request) for p in prepared]
    cohort = BeamCohort(trie, widths, contexts, exclusions, slots, [p.filter for p in prepared])
    (first,) = choices([cohort])
    apply_moves(select_together(first, column_logprobs(last_logits, first.token)))
    return cohort


def _pass_bases(trie: CodeTrie, widths: list[Width]) -> list[int]:
    """First BeamKV slot of each decode pass (pass p feeds level p's rows), then the slots needed in all."""
    schedules = [step_widths(trie, w) for w in widths]
    rows = [1] * len(schedules)  # before the first selection: one row per request
    bases = [0]
    for level in range(1, trie.levels):
        rows = [rows_after(trie, level - 1, s[level - 1], n) for s, n in zip(schedules, rows, strict=True)]
        bases.append(bases[-1] + sum(rows))
    return bases


def slots_needed(trie: CodeTrie, widths: list[Width]) -> int:
    return _pass_bases(trie, widths)[-1]


def fetch_finals(cohorts: list[BeamCohort]) -> list[tuple[list[float], list[int]]]:
    """Finished cohorts' final scores and items in ONE device-to-host transfer (float64 holds both exactly)."""
    packed = fetch(torch.cat([torch.stack([c.scores.double(), c.nodes.double()]) for c in cohorts], dim=1))
    out, start = [], 0
    for c in cohorts:
        part = packed[:, start : start + c.rows]
        out.append((part[0].tolist(), [int(i) for i in part[1].tolist()]))
        start += c.rows
    return out


def _excluded_node_keys(trie: CodeTrie, exclusions: list[np.ndarray], device, filters: list) -> list:
    """Per depth 1..D, keys `request * nodes + node` of nodes all of whose (allowed, if filtered) items are
    excluded, so they take no beam. Computed on the host before decoding, so it never waits on the device."""
    if any(f is not None for f in filters):  # a filtered request's exclusions: only the items it allows count
        exclusions = [e if f is None else e[f.items[e]] for e, f in zip(exclusions, filters, strict=True)]
    keys = []
    for depth in range(1, trie.levels + 1):
        nodes_here = trie.nodes_at(depth)
        parts = []
        for r, items in enumerate(exclusions):
            if len(items) == 0:
                continue
            nodes, counts = np.unique(trie.node_of_item[depth - 1][items], return_counts=True)
            allowed = filters[r]
            below = trie.leaves[depth - 1][nodes] if allowed is None else allowed.allowed_under(trie, depth, nodes)
            dead = nodes[counts == below]
            parts.append(r * nodes_here + dead)
        found = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        keys.append(to_device(found, device) if len(found) else None)
    return keys
