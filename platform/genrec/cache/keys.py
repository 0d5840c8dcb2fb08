"""User IDs (integers or strings) as int64 keys, vectorised; and the one check of IDs and vectors every writer runs
before anything is written (`checked_batch`). Integers are their own keys. A string's UTF-8 bytes are read 8 at a
time, each word mixed with its position, the words summed and the sum mixed with the byte length (so "ab" and
"ab\\x00" differ); strings travel as one Arrow array (offsets + bytes), so work is linear in the total bytes. Two
distinct strings collide with probability about n^2 / 2^65 (1e-7 for a million keys); the cache treats them as one
key. A batch holds integers or strings, never both; None is refused. Numpy's fixed-width str arrays cannot hold
trailing NULs: pass a list to keep them.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from genrec.errors import CacheError

EMPTY = np.int64(np.iinfo(np.int64).min)  # reserved: marks a free hash slot
TOMBSTONE = np.int64(np.iinfo(np.int64).min + 1)  # reserved: marks a deleted hash slot
_POSITION = np.uint64(0x9E3779B97F4A7C15)
_LENGTH = np.uint64(0x632BE59BD9B4E019)
_SHIFTS = np.uint64(30), np.uint64(27), np.uint64(31)
_MULTIPLIERS = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_TAIL_MASK = np.array([(1 << (8 * k)) - 1 for k in range(9)], dtype=np.uint64)  # the first k bytes of a word


def mix64(keys: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (a bijection of 64-bit words): spreads sequential IDs over the table. (Array integer
    arithmetic wraps modulo 2^64 without a warning, as the hash wants.)"""
    z = keys.view(np.uint64)
    z = z ^ (z >> _SHIFTS[0])
    z *= _MULTIPLIERS[0]
    z ^= z >> _SHIFTS[1]
    z *= _MULTIPLIERS[1]
    z ^= z >> _SHIFTS[2]
    return z


def normalize_keys(ids) -> np.ndarray:
    """ids: integers or strings (list, numpy or Arrow array, pandas Series) -> int64 keys [n]."""
    if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu":  # the hot path: no conversion
        if ids.ndim != 1:
            raise CacheError(f"ids must be one-dimensional, got shape {ids.shape}")
        return _integer_keys(ids)
    array = _as_arrow(ids)
    if len(array) == 0:
        return np.zeros(0, dtype=np.int64)
    if array.null_count:
        raise CacheError(f"ids: {array.null_count} of {len(array)} are None (null)")
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    if pa.types.is_integer(array.type):
        return _integer_keys(array.to_numpy())
    if pa.types.is_string(array.type) or pa.types.is_large_string(array.type) or pa.types.is_string_view(array.type):
        return hash_strings(array)
    raise CacheError(f"ids must be integers or strings, got {array.type}")


def _as_arrow(ids) -> pa.Array:
    if isinstance(ids, pa.ChunkedArray):
        return ids.combine_chunks()
    if isinstance(ids, pa.Array):
        return ids
    if isinstance(ids, str | bytes):
        raise CacheError("ids must be a sequence of IDs, got one string")
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1:
            raise CacheError(f"ids must be one-dimensional, got shape {ids.shape}")
        if ids.dtype.kind not in "UO":
            raise CacheError(f"ids must be integers or strings, got dtype {ids.dtype}")
        if ids.dtype.kind == "U":  # Arrow's own conversion of numpy str arrays stops at the first NUL
            ids = ids.astype(object)
    try:
        return pa.array(ids)
    except UnicodeError as e:
        raise CacheError(f"ids: a string is not valid Unicode ({e.reason})") from None
    except OverflowError:
        raise CacheError("ids: an integer does not fit in int64") from None
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise CacheError(f"ids must be all integers or all strings: {e}") from None


def _integer_keys(ids: np.ndarray) -> np.ndarray:
    if ids.dtype.kind == "u" and ids.dtype.itemsize == 8 and len(ids) and ids.max() > np.iinfo(np.int64).max:
        raise CacheError("ids: an integer does not fit in int64")
    keys = ids.astype(np.int64, copy=False)
    if (keys <= TOMBSTONE).any():
        raise CacheError(f"integer ids {EMPTY} and {TOMBSTONE} are reserved")
    return keys


def hash_strings(strings: pa.Array) -> np.ndarray:
    """An Arrow string array (no nulls) -> int64 keys, clear of the reserved values."""
    if not (pa.types.is_string(strings.type) or pa.types.is_large_string(strings.type)):
        strings = strings.cast(pa.large_string())
    n = len(strings)
    _, offsets_buffer, data_buffer = strings.buffers()
    offset_type = np.int32 if pa.types.is_string(strings.type) else np.int64
    offsets = np.frombuffer(
        offsets_buffer, dtype=offset_type, count=n + 1, offset=strings.offset * offset_type(0).itemsize
    )
    offsets = offsets.astype(np.int64)
    data = np.zeros(offsets[-1] + 8, dtype=np.uint8)  # 8 spare bytes: every word read stays inside
    if data_buffer is not None:
        data[: offsets[-1]] = np.frombuffer(data_buffer, dtype=np.uint8, count=offsets[-1])
    lengths = np.diff(offsets)
    words = (lengths + 7) >> 3
    first_word = np.cumsum(words) - words
    owner = np.repeat(np.arange(n), words)  # one entry per word, not per byte
    position = np.arange(len(owner)) - first_word[owner]
    # The little-endian 64-bit word at any byte offset (an unaligned view), masked to its string's bytes.
    word_at = np.ndarray(shape=(len(data) - 7,), dtype="<u8", buffer=data, strides=(1,))
    start = offsets[:-1][owner] + 8 * position
    word = word_at[start] & _TAIL_MASK[np.minimum(offsets[1:][owner] - start, 8)]
    mixed = mix64(word ^ (position.astype(np.uint64) * _POSITION))
    if words.all():
        total = np.add.reduceat(mixed, first_word) if n else np.zeros(0, dtype=np.uint64)
    else:  # reduceat cannot sum an empty run: empty strings keep 0
        total = np.zeros(n, dtype=np.uint64)
        total[words > 0] = np.add.reduceat(mixed, first_word[words > 0]) if len(mixed) else 0
    keys = mix64(total + mix64(lengths.astype(np.uint64) ^ _LENGTH)).view(np.int64)
    return np.where(keys <= TOMBSTONE, keys + 2, keys)  # keep clear of the reserved values


def check_dim(dim) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim <= 0:
        raise CacheError(f"dim must be a positive integer, got {dim!r}")
    return int(dim)


def as_vectors(vectors, rows: int, dim: int) -> np.ndarray:
    """vectors -> float32 [rows, dim], C-contiguous and finite; CacheError otherwise."""
    try:
        raw = np.asarray(vectors)
    except (TypeError, ValueError) as e:  # ragged nested lists
        raise CacheError(f"vectors must be a numeric [n, dim] array: {e}") from None
    if raw.dtype.kind not in "fiu":
        raise CacheError(f"vectors must be numeric, got dtype {raw.dtype}")
    if rows == 0 and raw.shape in ((0,), (0, dim)):
        return np.zeros((0, dim), dtype=np.float32)
    if raw.shape != (rows, dim):
        raise CacheError(f"vectors must have shape ({rows}, {dim}) (one row per ID), got {raw.shape}")
    with np.errstate(over="ignore"):  # float64 beyond float32's range becomes inf: refused below
        matrix = np.ascontiguousarray(raw, dtype=np.float32)
    if not np.isfinite(matrix).all():
        raise CacheError("vectors contain non-finite values (NaN or infinity, or beyond float32's range)")
    return matrix


def checked_batch(ids, vectors, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(int64 keys [n], float32 vectors [n, dim]) for a write of `vectors` under `ids`."""
    keys = normalize_keys(ids)
    return keys, as_vectors(vectors, len(keys), dim)
