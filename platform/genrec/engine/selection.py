"""The decode step's selection: from a pass's log-probabilities at its rows' trie children, every request's next
beams. What each row may choose is looked up before the pass (`choices`: the children, exclusions and filters);
after it, each request keeps its best candidates, eagerly (`select_together`: a top-k per request over its rows) or
inside a captured pass (`InGraphSelection`: one sort of keys in fixed shapes, read back by `select_ranked`). All of a
pass's selections are made before any cohort moves (`advance_all`). No loop over beams, no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby

import numpy as np
import torch

from genrec.catalog.trie import CodeTrie
from genrec.engine.row_layout import row_layout
from genrec.model.fused import candidate_scores

NEG_INF = float("-inf")
# The cohorts a selection moves are genrec.engine.beam's BeamCohorts (which import this module, not the reverse).
Move = tuple[object, tuple]  # a cohort and the arguments of its next `advance`, made by a selection


@dataclass
class Choices:
    """What one selection may choose (cohorts at one level of one trie), looked up before the pass that scores it.
    Per row of the cohorts (R rows) and child (C columns): token [R, C] (the columns the pass gathers), child [R, C],
    allowed [R, C] (a real child, not excluded, passing the request's filter), free [R, C] or None (a finished code's
    pad step: it keeps the row's score); per row its beam's score [R]. On the host: each request's rows, now and
    after the selection."""

    cohorts: list
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


def choices(cohorts: list) -> list[Choices]:
    """The selections after the next pass over the cohorts' rows: one per run of same-level cohorts of one catalog
    version (sorted so that each runs together: one selection each)."""
    return [_choices(list(group)) for _, group in groupby(cohorts, key=lambda c: (c.level, id(c.trie)))]


def _choices(cohorts: list) -> Choices:
    """Each request keeps `_rows_after` rows, known on the host so nothing syncs; rows it cannot fill (exclusions, a
    widening schedule) score -inf and are dropped from the results."""
    first = cohorts[0]
    trie, level = first.trie, first.level
    nodes = first.nodes if len(cohorts) == 1 else torch.cat([c.nodes for c in cohorts])
    scores = first.scores if len(cohorts) == 1 else torch.cat([c.scores for c in cohorts])
    token, child, valid = trie.children(level, nodes)
    rows_per_req = [n for c in cohorts for n in c.rows_per_req]
    widths = [w[level] for c in cohorts for w in c.widths]
    new_rows = [rows_after(trie, level, w, n) for w, n in zip(widths, rows_per_req, strict=True)]
    row_req = row_layout(tuple(rows_per_req), first.device)["row_req"]
    allowed = valid & ~_excluded(cohorts, level, row_req, child)
    _filter(cohorts, level, rows_per_req, child, allowed)
    free = trie.free[level][child] if trie.free[level] is not None else None  # trie.py: codes of fewer tokens
    return Choices(cohorts, token, child, allowed, free, scores, rows_per_req, new_rows)


def advance_all(selections: list[Choices], gains: torch.Tensor, order=None) -> None:
    """After one decode pass over the selections' rows (in this order; its K/V written: DecodeBatch.write_kv): run
    each selection. gains [rows, >= C]: each row's log-probabilities at its children's tokens (`Choices.token`);
    or, with `order` (the selection ran inside the pass: `InGraphSelection.ranked`), its children's scores, ranked.
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
    current = row_layout(tuple(selection.rows_per_req), device)
    chosen = row_layout(tuple(selection.new_rows), device)
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
    current = row_layout(tuple(selection.rows_per_req), device)
    chosen = row_layout(tuple(selection.new_rows), device)
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


def rows_after(trie: CodeTrie, level: int, width: int, rows: int) -> int:
    """A request's rows after the selection at `level` from `rows` rows: its width there, but never more than the
    nodes at the next depth nor its rows' children (a schedule that widens cannot fill more)."""
    return min(width, trie.nodes_at(level + 1), rows * trie.max_children[level])


def _excluded(cohorts: list, level: int, row_req: torch.Tensor, child: torch.Tensor) -> torch.Tensor:
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


def _filter(cohorts: list, level: int, rows_per_req: list[int], child, allowed: torch.Tensor) -> None:
    """ANDs each filtered request's node mask into its rows' allowed children, in place (host offsets: no sync)."""
    start = 0
    masks = (f for c in cohorts for f in c.filters)
    for rows, mask in zip(rows_per_req, masks, strict=True):
        if mask is not None:
            allowed[start : start + rows] &= mask.on(allowed.device)[level][child[start : start + rows]]
        start += rows


class InGraphSelection:
    """What a captured pass that selects its beams itself reads besides its gains, in fixed buffers of its bucket's
    rows (padding rows allow nothing): the rows' scores, allowed and free children, and each row's request."""

    def __init__(self, bucket: int, columns: int, device):
        self.scores = torch.zeros(bucket, dtype=torch.float32, device=device)
        self.allowed = torch.zeros(bucket, columns, dtype=torch.bool, device=device)
        self.free = torch.zeros(bucket, columns, dtype=torch.bool, device=device)
        self.segment = torch.zeros(bucket, dtype=torch.int64, device=device)  # padding rows after every request

    def fill(self, selections: list[Choices], counts: list[int], pad: int) -> tuple:
        """The selections' scores, allowed and free children into their rows (device to device); the padding
        allows nothing. Returns the segment table's (buffer, host copy, dtype), for the pass's staged copies."""
        row = 0
        for selection in selections:
            rows, C = slice(row, row + selection.rows), selection.columns
            self.scores[rows] = selection.scores
            self.allowed[rows, :C] = selection.allowed
            self.free[rows, :C] = selection.free if selection.free is not None else False
            if C < self.allowed.shape[1]:
                self.allowed[rows, C:] = False
            row = rows.stop
        self.allowed[row:] = False
        return self.segment, np.repeat(np.arange(len(counts) + 1), [*counts, pad]), torch.int64

    def ranked(self, pieces, gains: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inside the pass: its candidates [B, W] and, per request, their flat indices best first [B, W] (one stable
        sort of `fused.selection_keys`, the plan's piece: every request's top-k in fixed shapes)."""
        cand, keys = pieces.selection_keys(self.scores, gains, self.allowed, self.free, self.segment)
        return cand, keys.flatten().sort(stable=True).indices.view_as(keys)
