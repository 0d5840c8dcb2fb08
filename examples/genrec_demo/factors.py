"""Item and user vectors from a truncated SVD of the training user-item matrix.

Item rows are normalised to unit length before they become semantic IDs: raw factors let popular items
dominate the residual k-means (a few prefixes take hundreds of items). User rows feed the soft token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from genrec_demo.data import MovieLens


@dataclass
class Factors:
    items: np.ndarray  # [items, rank] unit rows (all-zero for items without training interactions)
    users: np.ndarray  # [users, rank] unit rows


def svd_factors(data: MovieLens, rank: int) -> Factors:
    matrix = torch.zeros(len(data.user_ids), data.num_items)
    for u in range(len(data.user_ids)):
        matrix[u, torch.from_numpy(data.train(u))] = 1.0
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    scale = s[:rank].sqrt()
    items, users = vh[:rank].T * scale, u[:, :rank] * scale
    pad = rank - len(scale)  # fewer users than `rank` (a slice): zero columns keep every vector `rank` long
    return Factors(_unit_rows(F.pad(items, (0, pad))), _unit_rows(F.pad(users, (0, pad))))


def _unit_rows(x: torch.Tensor) -> np.ndarray:
    return (x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)).numpy()
