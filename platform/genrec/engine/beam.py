"""Constrained wide beam search over the catalog trie, for a cohort of requests that step together
(docs/design.md, 'Shared-context attention' for BeamKV/BeamPath; 'Constrained decoding over a flat trie').

BeamKV: pass p's rows write slots base[p] + row, never reordered; BeamPath (`ancestors`): [rows, passes] slot
indices. Everything is a tensor op over all rows of all requests: no loop over beams, no host sync until
`results()`. A request's schedule keeps schedule[l] rows after step l; steps past it (ending tokens) keep the last
width. A filtered request ANDs its per-step node mask into its rows' children: one gather per filtered request.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

import numpy as np
import torch

from genrec.catalog.trie import CodeTrie
from genrec.model.fused import candidate_scores, column_logprobs
from genrec.model.kv_pool import ContextKV, Extent
from genrec.staging import fetch, to_device

NEG_INF = float("-inf")


Width = int | Sequence[int]  # one width for every step, or one per code level (see the module's docstring)
Move = tuple["BeamCohort", tuple]  # a cohort and the arguments of its next `advance`, made by a selection


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
        row_req = _layout(tuple(self.rows_per_req), self.device)["row_req"]
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


@dataclass
class Choices:
    """What one selection may choose (cohorts at one level of one trie), looked up before the pass that scores it.
    Per row of the cohorts (R rows) and child (C columns): token [R, C] (the columns the pass gathers), child [R, C],
    allowed [R, C] (a real child, not excluded, passing the request's filter), free [R, C] or None (a finished code's
    pad step: it keeps the row's score); per row its beam's score [R]. On the host: each request's rows, now and
    after the selection."""

    cohorts: list[BeamCohort]
    token: torch.Tensor
    child: torch.Tensor
    allowed: torch.Tensor
    free: torch.Tensor | None
    scores: torch.Tensor
    rows_per_req: list[int]
    new_rows: list[int]

    @property
    def rows(self) -> int:
        return self.token.shape[0]

    @property
    def columns(self) -> int:
        return self.token.shape[1]


def choices(cohorts: list[BeamCohort]) -> list[Choices]:
    """The selections after the next pass over the cohorts' rows: one per run of same-level cohorts of one catalog
    version (sorted so that each runs together: one selection each)."""
    return [_choices(list(group)) for _, group in groupby(cohorts, key=lambda c: (c.level, id(c.trie)))]


def _choices(cohorts: list[BeamCohort]) -> Choices:
    """Each request keeps `_rows_after` rows, known on the host so nothing syncs; rows it cannot fill (exclusions, a
    widening schedule) score -inf and are dropped from the results."""
    first = cohorts[0]
    trie, level = first.trie, first.level
    nodes = first.nodes if len(cohorts) == 1 else torch.cat([c.nodes for c in cohorts])
    scores = first.scores if len(cohorts) == 1 else torch.cat([c.scores for c in cohorts])
    token, child, valid = trie.children(level, nodes)
    rows_per_req = [n for c in cohorts for n in c.rows_per_req]
    widths = [w[level] for c in cohorts for w in c.widths]
    new_rows = [_rows_after(trie, level, w, n) for w, n in zip(widths, rows_per_req, strict=True)]
    row_req = _layout(tuple(rows_per_req), first.device)["row_req"]
    allowed = valid & ~_excluded(cohorts, level, row_req, child)
    _filter(cohorts, level, rows_per_req, child, allowed)
    free = trie.free[level][child] if trie.free[level] is not None else None  # trie.py: codes of fewer tokens
    return Choices(cohorts, token, child, allowed, free, scores, rows_per_req, new_rows)


def advance_all(selections: list[Choices], gains: torch.Tensor, order=None) -> None:
    """After one decode pass over the selections' rows (in this order; its K/V recorded: DecodeBatch.record_kv): run
    each selection. gains [rows, >= C]: each row's log-probabilities at its children's tokens (`Choices.token`);
    or, with `order` (the selection ran inside the pass: `DecodeBatch.ranked`), its children's scores, ranked.
    Every selection is made before any cohort moves: one that fails leaves them all as they were, so the retry of
    each request alone (Scheduler._guarded) runs the same level again."""
    moves, start = [], 0
    for selection in selections:
        stop = start + selection.rows
        if order is None:
            moves += select_together(selection, gains[start:stop])
        else:
            moves += select_ranked(selection, gains, order, start)
        start = stop
    apply_moves(moves)


def apply_moves(moves: list[Move]) -> None:
    for cohort, step in moves:
        cohort.advance(*step)


def select_together(selection: Choices, gains: torch.Tensor) -> list[Move]:
    """One vectorised selection for cohorts at the same level; gains [rows of all cohorts, in order, >= C]: the
    log-probabilities of each row's children's tokens (columns past C are ignored). Each request's best children
    by a top-k over its rows' candidates, padded to the most rows any of its requests has."""
    C, device = selection.columns, selection.token.device
    current = _layout(tuple(selection.rows_per_req), device)
    chosen = _layout(tuple(selection.new_rows), device)
    cand = candidate_scores(selection.scores, gains[:, :C], selection.allowed, selection.free)
    padded = cand[current["pad_rows"]].masked_fill(~current["pad_valid"][..., None], NEG_INF).flatten(1)
    k = min(max(selection.new_rows), padded.shape[1])
    top_scores, top_index = padded.topk(k, dim=1)

    req, rank = chosen["row_req"], chosen["row_rank"]
    clamped = rank.clamp(max=k - 1)
    new_scores = top_scores[req, clamped].masked_fill(rank >= k, NEG_INF)
    flat = top_index[req, clamped]
    return _moves(selection, current["pad_rows"][req, flat // C], flat % C, new_scores)


def select_ranked(selection: Choices, cand: torch.Tensor, order: torch.Tensor, start: int) -> list[Move]:
    """The selection of rows [start, start + selection.rows) of a pass that ranked its candidates itself: cand
    [pass rows, W] their scores, order [pass rows, W] the flat indices of cand by request, best first (each
    request's segment starts at W times its first row). A request's new row of rank q is its segment's q-th."""
    W, device = cand.shape[1], cand.device
    # A request's picks stay in its own segment: it never keeps more rows than it has candidates (`_rows_after`).
    assert all(n <= rows * W for n, rows in zip(selection.new_rows, selection.rows_per_req, strict=True))
    current = _layout(tuple(selection.rows_per_req), device)
    chosen = _layout(tuple(selection.new_rows), device)
    at = (start + current["first_row"][chosen["row_req"]]) * W + chosen["row_rank"]
    flat = order.flatten()[at]
    parent = flat // W - start if start else flat // W
    # A pick past a row's own children scores -inf (never allowed): any column of it makes the same move.
    return _moves(selection, parent, (flat % W).clamp_(max=selection.columns - 1), cand.flatten()[flat])


def _moves(selection: Choices, parent: torch.Tensor, col: torch.Tensor, new_scores: torch.Tensor) -> list[Move]:
    """The new rows (in request order) as each cohort's next step: parent [new rows] (a row of the selection), the
    child's column and the new scores. Parents become cohort-local again."""
    new_tokens, new_nodes = selection.token[parent, col], selection.child[parent, col]
    moves, old_row, new_row, request = [], 0, 0, 0
    for c in selection.cohorts:
        n_req, old_rows = len(c.widths), c.rows
        mine = selection.new_rows[request : request + n_req]
        rows = slice(new_row, new_row + sum(mine))
        local = parent[rows] - old_row if old_row else parent[rows]
        moves.append((c, (local, new_tokens[rows], new_nodes[rows], new_scores[rows], mine)))
        old_row, new_row, request = old_row + old_rows, rows.stop, request + n_req
    return moves


def _rows_after(trie: CodeTrie, level: int, width: int, rows: int) -> int:
    """A request's rows after the selection at `level` from `rows` rows: its width there, but never more than the
    nodes at the next depth nor its rows' children (a schedule that widens cannot fill more)."""
    return min(width, trie.nodes_at(level + 1), rows * trie.max_children[level])


def _pass_bases(trie: CodeTrie, widths: list[Width]) -> list[int]:
    """First BeamKV slot of each decode pass (pass p feeds level p's rows), then the slots needed in all."""
    schedules = [step_widths(trie, w) for w in widths]
    rows = [1] * len(schedules)  # before the first selection: one row per request
    bases = [0]
    for level in range(1, trie.levels):
        rows = [_rows_after(trie, level - 1, s[level - 1], n) for s, n in zip(schedules, rows, strict=True)]
        bases.append(bases[-1] + sum(rows))
    return bases


def slots_needed(trie: CodeTrie, widths: list[Width]) -> int:
    return _pass_bases(trie, widths)[-1]


def _layout(rows_per_req: tuple[int, ...], device) -> dict[str, torch.Tensor]:
    """Index tensors of a row layout (request r owns rows_per_req[r] consecutive rows), built on the host and cached:
    pad_rows/pad_valid [N, max rows] (each request's rows, padded), first_row [N], row_req/row_rank [rows]."""
    key = (rows_per_req, str(device))
    with _LAYOUTS_LOCK:  # engines in one process (tests, benches) each step in their own thread
        found = _LAYOUTS.get(key)
        if found is not None:
            _LAYOUTS.move_to_end(key)
    if found is None:
        counts = np.asarray(rows_per_req)
        offsets = counts.cumsum() - counts
        slots = np.arange(max(rows_per_req))
        row_req = np.repeat(np.arange(len(rows_per_req)), counts)
        found = {
            "pad_rows": to_device(offsets[:, None] + np.minimum(slots[None, :], counts[:, None] - 1), device),
            "pad_valid": to_device(slots[None, :] < counts[:, None], device, torch.bool),
            "first_row": to_device(offsets, device),
            "row_req": to_device(row_req, device),
            "row_rank": to_device(np.arange(len(row_req)) - offsets[row_req], device),
        }
        _remember_layout(key, found)
    return found


# Layouts by (rows per request, device), LRU first. Bounded in bytes: every new mix of running requests makes one
# (64 requests of beam 64: ~100 KB), so the former cap of 4,096 entries let it grow to ~400 MB at worst.
_LAYOUTS: OrderedDict[tuple, dict[str, torch.Tensor]] = OrderedDict()
_LAYOUTS_LOCK = threading.Lock()
LAYOUT_CACHE_BYTES = 8 << 20
_layout_bytes = 0


def _nbytes(layout: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in layout.values())


def _remember_layout(key: tuple, layout: dict[str, torch.Tensor]) -> None:
    """Keep the layout; forget the least recently used ones while the cache holds over LAYOUT_CACHE_BYTES."""
    global _layout_bytes
    with _LAYOUTS_LOCK:
        old = _LAYOUTS.pop(key, None)  # another engine's thread may have built it meanwhile
        if old is not None:
            _layout_bytes -= _nbytes(old)
        _LAYOUTS[key] = layout
        _layout_bytes += _nbytes(layout)
        while _layout_bytes > LAYOUT_CACHE_BYTES and len(_LAYOUTS) > 1:
            _, old = _LAYOUTS.popitem(last=False)
            _layout_bytes -= _nbytes(old)


def _excluded(cohorts: list[BeamCohort], level: int, row_req: torch.Tensor, child: torch.Tensor) -> torch.Tensor:
    """Rows' candidate children that lead only to excluded items: a binary search of the sorted keys
    (`isin` would sort and call `unique`, which waits for the device)."""
    nodes = cohorts[0].trie.nodes_at(level + 1)
    keys, request = [], 0
    for c in cohorts:
        if c._excluded[level] is not None:
            keys.append(c._excluded[level] + request * nodes if request else c._excluded[level])
        request += len(c.widths)
    if not keys:
        return torch.zeros_like(child, dtype=torch.bool)
    keys = keys[0] if len(keys) == 1 else torch.cat(keys)  # sorted: by request, then node
    query = row_req[:, None] * nodes + child
    return keys[torch.searchsorted(keys, query).clamp_(max=len(keys) - 1)] == query


def _filter(cohorts: list[BeamCohort], level: int, rows_per_req: list[int], child, allowed: torch.Tensor) -> None:
    """ANDs each filtered request's node mask into its rows' allowed children, in place (host offsets: no sync)."""
    start = 0
    masks = (f for c in cohorts for f in c.filters)
    for rows, mask in zip(rows_per_req, masks, strict=True):
        if mask is not None:
            allowed[start : start + rows] &= mask.on(allowed.device)[level][child[start : start + rows]]
        start += rows


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
