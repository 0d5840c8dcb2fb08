"""User IDs (integers or strings) as int64 keys, vectorised.

Integers are their own keys. Strings are hashed over their UTF-8 bytes, 8 at a time: each 8-byte word is
mixed with its position in the string, a string's words are summed, and the sum is mixed with the string's
byte length (so "ab" and "ab\\x00" differ). Strings travel as one Arrow string array (offsets + bytes), so
no string is padded to the longest one and work is linear in the total bytes; a Python list costs only
Arrow's conversion. Two distinct strings collide with probability about n^2 / 2^65 (1e-7 for a million
keys); the cache treats them as one key.

A batch holds integers or strings, never both; None is refused (pandas object columns of ints are ints).
Numpy's fixed-width str arrays cannot hold trailing NUL characters: pass a list to keep them.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from genrec.errors import CacheError

EMPTY = np.int64(np.iinfo(np.int64).min)  # reserved: marks a free hash slot
TOMBSTONE = np.int64(np.iinfo(np.int64).min + 1)  # reserved: marks a deleted hash slot
_POSITION = np.uint64(0x9E3779B97F4A7C15)
_LENGTH = np.uint64(0x632BE59BD9B4E019)
_ALL_BYTES = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix64(keys: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (a bijection of 64-bit words): spreads sequential IDs over the table."""
    z = keys.view(np.uint64).copy()
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
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
    try:
        return pa.array(ids)
    except UnicodeError as e:
        raise CacheError(f"ids: a string is not valid Unicode ({e.reason})") from None
    except OverflowError:
        raise CacheError("ids: an integer does not fit in int64") from None
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise CacheError(f"ids must be all integers or all strings: {e}") from None


def _integer_keys(ids: np.ndarray) -> np.ndarray:
    if ids.dtype == np.uint64 and len(ids) and ids.max() > np.iinfo(np.int64).max:
        raise CacheError("ids: an integer does not fit in int64")
    keys = ids.astype(np.int64, copy=False)
    if (keys <= TOMBSTONE).any():
        raise CacheError(f"integer ids {EMPTY} and {TOMBSTONE} are reserved")
    return keys


def hash_strings(strings: pa.Array) -> np.ndarray:
    """An Arrow string array (no nulls) -> int64 keys, clear of the reserved values."""
    strings = strings.cast(pa.large_string())
    n = len(strings)
    _, offsets_buffer, data_buffer = strings.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=np.int64, count=n + 1, offset=8 * strings.offset)
    data = np.zeros(int(offsets[-1]) + 8, dtype=np.uint8)  # 8 spare bytes: every word read stays inside
    if data_buffer is not None:
        data[: offsets[-1]] = np.frombuffer(data_buffer, dtype=np.uint8, count=int(offsets[-1]))
    lengths = np.diff(offsets)
    words = (lengths + 7) // 8
    first_word = np.cumsum(words) - words
    owner = np.repeat(np.arange(n), words)  # one entry per word, not per byte
    position = np.arange(len(owner)) - first_word[owner]
    # The little-endian 64-bit word at any byte offset (an unaligned view), masked to its string's bytes.
    word_at = np.ndarray(shape=(len(data) - 7,), dtype="<u8", buffer=data, strides=(1,))
    word = word_at[offsets[:-1][owner] + 8 * position]
    tail = np.minimum(lengths[owner] - 8 * position, 8).astype(np.uint64)
    word &= np.where(tail == 8, _ALL_BYTES, (np.uint64(1) << (np.uint64(8) * tail % np.uint64(64))) - np.uint64(1))
    with np.errstate(over="ignore"):
        mixed = mix64(word ^ (position.astype(np.uint64) * _POSITION))
        total = np.zeros(n, dtype=np.uint64)
        nonempty = words > 0
        if len(mixed):
            total[nonempty] = np.add.reduceat(mixed, first_word[nonempty])
        keys = mix64(total + mix64(lengths.astype(np.uint64) ^ _LENGTH)).view(np.int64)
    return np.where(keys <= TOMBSTONE, keys + 2, keys)  # keep clear of the reserved values
