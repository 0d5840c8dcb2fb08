"""The catalog's prefix trie as flat tensors (docs/design.md, 'Constrained decoding over a flat trie').

A sequence is an item's code, then the layout's ending tokens. Shorter ones are padded to the longest with free
steps: a finished node has one pad child whose log-probability counts as 0, so a finished code keeps its beam at its
final score (`free[l]` marks the pad nodes). Step l's CSR: `ptr[l][node]..ptr[l][node+1]` indexes `token[l]` (fed to
the next pass) and `child[l]` (the depth-(l+1) node; at the last step, the code). Items sharing a code share its path.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

PAD = -1


@dataclass
class CodeTrie:
    ptr: list[torch.Tensor]  # per step: [nodes_l + 1]
    token: list[torch.Tensor]  # per step: [edges_l]
    child: list[torch.Tensor]  # per step: [edges_l]
    max_children: list[int]  # per step, host-side
    node_of_item: list[np.ndarray]  # per depth p = 1..S: [N] the item's depth-p node (depth S: its code)
    leaves: list[np.ndarray]  # per depth p = 1..S: [nodes_p] items below each node (host: used before decoding)
    free: list[torch.Tensor | None] = None  # per step: [nodes_{l+1}] bool, the pad nodes; None: no pad at this step
    code_ptr: np.ndarray = None  # [codes + 1] host: code c's items are code_items[code_ptr[c]:code_ptr[c+1]]
    code_items: np.ndarray = None  # [N] host: catalog indices grouped by code, each code's in the catalog's order

    @property
    def levels(self) -> int:
        """Decode steps: the longest code plus its ending."""
        return len(self.ptr)

    @property
    def codes(self) -> int:
        return self.nodes_at(self.levels)

    @cached_property
    def first_item(self) -> list[np.ndarray]:
        """Per depth p = 1..S: [nodes_p] where each node's items start in `code_items`. Nodes are numbered in the
        order of their sequences, so a node's items are one run there: first_item[p][n], leaves[p][n] long."""
        return [np.cumsum(count) - count for count in self.leaves]

    def nodes_at(self, depth: int) -> int:
        return len(self.leaves[depth - 1])

    def items_of(self, code: int) -> np.ndarray:
        """The catalog indices of a code's items, in order (popularity, highest first; ties in catalog order)."""
        return self.code_items[self.code_ptr[code] : self.code_ptr[code + 1]]

    @classmethod
    def build(cls, codes: np.ndarray, device="cpu", lengths=None, ending=(), popularity=None) -> CodeTrie:
        """codes [N, D] token IDs (PAD past each row's `lengths`, default all D); `ending`: token IDs forced after
        every code; `popularity` [N] orders the items of a shared code (highest first)."""
        sequences = _sequences(codes, lengths, ending)
        feed = ending[-1] if len(ending) else 0  # what a pad edge feeds the next pass: any valid token
        n = len(sequences)
        parent = np.zeros(n, dtype=np.int64)  # every item's depth-0 node is the root
        ptr, token, child, max_children, node_of_item, leaves, free = [], [], [], [], [], [], []
        nodes_before = 1
        for step in range(sequences.shape[1]):
            # One node per distinct (parent, token): sorting the packed pairs sorts edges by parent (a CSR).
            base = int(sequences[:, step].max()) + 2
            edge_keys, node = np.unique(parent * base + (sequences[:, step] + 1), return_inverse=True)
            node = node.reshape(-1)
            edge_token = edge_keys % base - 1
            counts = np.bincount(edge_keys // base, minlength=nodes_before)
            pads = edge_token == PAD
            ptr.append(np.concatenate([[0], np.cumsum(counts)]))
            token.append(np.where(pads, feed, edge_token))
            child.append(np.arange(len(edge_keys)))
            max_children.append(int(counts.max()))
            node_of_item.append(node)
            leaves.append(np.bincount(node, minlength=len(edge_keys)))
            free.append(torch.as_tensor(pads, device=device) if pads.any() else None)
            parent, nodes_before = node, len(edge_keys)
        order = _shared_code_order(parent, popularity)

        def tensors(arrays):
            return [torch.as_tensor(a, dtype=torch.int64, device=device) for a in arrays]

        code_ptr = np.concatenate([[0], np.cumsum(np.bincount(parent, minlength=nodes_before))])
        return cls(
            tensors(ptr), tensors(token), tensors(child), max_children, node_of_item, leaves, free, code_ptr, order
        )

    def children(self, level: int, nodes: torch.Tensor):
        """For nodes [R] at depth `level`: (token [R, C], child [R, C], valid [R, C]), C = max children."""
        start = self.ptr[level][nodes]
        count = self.ptr[level][nodes + 1] - start
        offsets = torch.arange(self.max_children[level], device=nodes.device)
        valid = offsets[None, :] < count[:, None]
        edge = (start[:, None] + offsets[None, :]).clamp_(max=len(self.token[level]) - 1)
        return self.token[level][edge], self.child[level][edge], valid

    def to(self, device) -> CodeTrie:
        """The trie with its tensors on `device`: on CUDA copied asynchronously from pinned memory (the engine's
        thread makes it at a catalog's first use: it must not wait for the device)."""
        cuda = torch.device(device).type == "cuda"

        def move(ts):
            return [None if t is None else (t.pin_memory() if cuda else t).to(device, non_blocking=cuda) for t in ts]

        return CodeTrie(
            move(self.ptr),
            move(self.token),
            move(self.child),
            self.max_children,
            self.node_of_item,
            self.leaves,
            move(self.free),
            self.code_ptr,
            self.code_items,
        )


def _sequences(codes: np.ndarray, lengths, ending) -> np.ndarray:
    """[N, D + len(ending)]: each code, then the ending right after its last token, PAD after that."""
    n, width = codes.shape
    lengths = np.full(n, width, dtype=np.int64) if lengths is None else np.asarray(lengths, dtype=np.int64)
    out = np.full((n, width + len(ending)), PAD, dtype=np.int64)
    out[:, :width] = np.where(np.arange(width)[None, :] < lengths[:, None], codes, PAD)
    rows = np.arange(n)
    for k, token_id in enumerate(ending):  # a few tokens at most: one scatter each
        out[rows, lengths + k] = token_id
    return out


def _shared_code_order(code_of_item: np.ndarray, popularity) -> np.ndarray:
    """Catalog indices grouped by code; within a code, popularity descending, ties in catalog order."""
    rows = np.arange(len(code_of_item))
    if popularity is None:
        return np.lexsort((rows, code_of_item))
    return np.lexsort((rows, -np.asarray(popularity, dtype=np.float64), code_of_item))
