"""The catalog's prefix trie as flat tensors, for constrained decoding without Python per beam.

Nodes at depth p are the distinct code prefixes of length p (depth 0: the root). For each step l
(choosing the level-l token) a CSR maps a depth-l node to its children: `ptr[l][node]..ptr[l][node+1]`
indexes `token[l]` (the token ID) and `child[l]` (the depth-(l+1) node; at the last level, the item
index). One gather per step yields every beam's allowed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class CodeTrie:
    ptr: list[torch.Tensor]  # per step: [nodes_l + 1]
    token: list[torch.Tensor]  # per step: [edges_l]
    child: list[torch.Tensor]  # per step: [edges_l]
    max_children: list[int]  # per step, host-side
    node_of_item: list[np.ndarray]  # per depth p = 1..D: [N] the item's depth-p node (depth D = item index)
    leaves: list[np.ndarray]  # per depth p = 1..D: [nodes_p] items below each node (host: used before decoding)

    @property
    def levels(self) -> int:
        return len(self.ptr)

    def nodes_at(self, depth: int) -> int:
        return len(self.leaves[depth - 1])

    @classmethod
    def build(cls, codes: np.ndarray, device="cpu") -> CodeTrie:
        n, levels = codes.shape
        parent = np.zeros(n, dtype=np.int64)  # every item's depth-0 node is the root
        ptr, token, child, max_children, node_of_item, leaves = [], [], [], [], [], []
        for level in range(levels):
            last = level == levels - 1
            if last:
                node = np.arange(n, dtype=np.int64)  # codes are unique: depth-D nodes are the items
            else:
                _, node = np.unique(codes[:, : level + 1], axis=0, return_inverse=True)
                node = node.reshape(-1)
            # One edge per distinct (parent, child), sorted by parent so a CSR can index it.
            edge_keys, first = np.unique(np.stack([parent, node], 1), axis=0, return_index=True)
            counts = np.bincount(edge_keys[:, 0], minlength=int(parent.max()) + 1)
            ptr.append(np.concatenate([[0], np.cumsum(counts)]))
            token.append(codes[first, level])
            child.append(edge_keys[:, 1])
            max_children.append(int(counts.max()))
            node_of_item.append(node)
            leaves.append(np.bincount(node))
            parent = node

        def tensors(arrays):
            return [torch.as_tensor(a, dtype=torch.int64, device=device) for a in arrays]

        return cls(tensors(ptr), tensors(token), tensors(child), max_children, node_of_item, leaves)

    def children(self, level: int, nodes: torch.Tensor):
        """For nodes [R] at depth `level`: (token [R, C], child [R, C], valid [R, C]), C = max children."""
        start = self.ptr[level][nodes]
        count = self.ptr[level][nodes + 1] - start
        offsets = torch.arange(self.max_children[level], device=nodes.device)
        valid = offsets[None, :] < count[:, None]
        edge = (start[:, None] + offsets[None, :]).clamp_(max=len(self.token[level]) - 1)
        return self.token[level][edge], self.child[level][edge], valid

    def to(self, device) -> CodeTrie:
        def move(ts):
            return [t.to(device) for t in ts]

        return CodeTrie(
            move(self.ptr), move(self.token), move(self.child), self.max_children, self.node_of_item, self.leaves
        )
