"""User IDs (int64 or strings) as int64 keys, vectorised.

Strings are hashed with a 64-bit FNV-1a over their UTF-8 bytes, computed column by column over a
fixed-width byte matrix: no Python work per key. Two distinct strings collide with probability about
n^2 / 2^65 (1e-7 for a million keys); the cache treats them as one key.
"""

from __future__ import annotations

import numpy as np

EMPTY = np.int64(np.iinfo(np.int64).min)  # reserved: marks a free hash slot
TOMBSTONE = np.int64(np.iinfo(np.int64).min + 1)  # reserved: marks a deleted hash slot
_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


def normalize_keys(ids) -> np.ndarray:
    """ids: int sequence/array or str sequence/array -> int64 keys [n]."""
    array = np.asarray(ids)
    if array.ndim != 1:
        raise ValueError(f"ids must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind in "iu":
        keys = array.astype(np.int64)
        if (keys <= TOMBSTONE).any():
            raise ValueError(f"integer ids {EMPTY} and {TOMBSTONE} are reserved")
        return keys
    if array.dtype.kind in "UO":
        return hash_strings(array)
    raise ValueError(f"ids must be integers or strings, got dtype {array.dtype}")


def hash_strings(strings: np.ndarray) -> np.ndarray:
    encoded = np.char.encode(strings.astype(str), "utf-8")  # fixed-width bytes, zero-padded
    width = encoded.dtype.itemsize
    matrix = np.frombuffer(encoded.tobytes(), dtype=np.uint8).reshape(len(strings), width)
    lengths = np.char.str_len(encoded)
    h = np.full(len(strings), _FNV_OFFSET, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for col in range(width):
            live = lengths > col
            mixed = (h ^ matrix[:, col].astype(np.uint64)) * _FNV_PRIME
            h = np.where(live, mixed, h)
    keys = h.view(np.int64)
    return np.where(keys <= TOMBSTONE, keys + 2, keys)  # keep clear of the reserved values
