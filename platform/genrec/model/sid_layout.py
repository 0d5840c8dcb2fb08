"""A model's semantic-ID layout: which token IDs form each code level, the code's wrappers, its label tokens.

Read from `genrec/sid_layout.json` when present, else inferred from the tokenizer's vocabulary. The decode never sees
where it came from: the trie is built from the catalog's token IDs and `ending`. The file's schema and the presets:
docs/engine.md, 'The SID layout' (beyond it: `begin` may be null; `labels` are (positive, negative) words).
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from genrec.errors import CatalogError, ModelDirectoryError

LAYOUT_FILE = "sid_layout.json"
LAYOUT_VERSION = 1
ENDINGS = ("none", "end_token", "newline_eos", "eos")
LETTERS = string.ascii_lowercase
SID_BEGIN, SID_END = "<|sid_begin|>", "<|sid_end|>"
PRESETS = {
    "genrec": {"name_prefix": "", "begin": None, "ending": "none", "labels": ("yes", "no")},
    "openonerec": {
        "name_prefix": "s_",
        "begin": SID_BEGIN,
        "ending": "end_token",
        "end_token": SID_END,
        "labels": ("是", "否"),
    },
    "minionerec": {"name_prefix": "", "begin": None, "ending": "newline_eos", "labels": ("yes", "no")},
}
_KEYS = {"version", "preset", "levels", "begin", "ending", "end_token", "labels"}


@dataclass(frozen=True, eq=False)
class SidLayout:
    """Per level, its codes' token IDs (`level_ids[l]`, ordered by code index `level_indices[l]`); the begin token
    (forced before a code, outside the trie); the ending (forced after a code, in the trie and `logprob`); labels."""

    level_ids: tuple[np.ndarray, ...]  # per level: [codes] int64 token IDs
    level_indices: tuple[np.ndarray, ...]  # per level: [codes] int64 code index of each ID, ascending
    begin: int | None = None
    ending_kind: str = "none"
    ending: tuple[int, ...] = ()
    labels: tuple[str, str] = ("yes", "no")
    source: str = "inferred"
    _level_of: np.ndarray = field(default=None, repr=False)  # token ID -> level, -1 for none

    def __post_init__(self):
        top = max((int(ids.max()) for ids in self.level_ids if len(ids)), default=-1)
        level_of = np.full(top + 1, -1, dtype=np.int16)
        for level, ids in enumerate(self.level_ids):
            taken = ids[level_of[ids] >= 0]
            if len(taken):
                raise ModelDirectoryError(
                    self.source, f"token ID {int(taken[0])} belongs to level {int(level_of[taken[0]])} and {level}"
                )
            level_of[ids] = level
        object.__setattr__(self, "_level_of", level_of)
        wrappers = [t for t in (self.begin, *self.ending) if t is not None]
        clash = [t for t in wrappers if t < len(level_of) and level_of[t] >= 0]
        if clash:
            raise ModelDirectoryError(self.source, f"wrapper/ending token ID {clash[0]} is also a code token")

    def token_id_list(self) -> list[int]:
        wrappers = [t for t in (self.begin, *self.ending) if t is not None]
        return [*np.concatenate(self.level_ids).tolist(), *wrappers]

    @property
    def levels(self) -> int:
        """The longest code, in tokens (codes may be shorter: 1..levels)."""
        return len(self.level_ids)

    @property
    def level_sizes(self) -> list[int]:
        return [len(ids) for ids in self.level_ids]

    @property
    def has_ending(self) -> bool:
        return bool(self.ending)

    def level_of(self, token_ids) -> np.ndarray:
        """The level of each token ID (any shape), -1 for a token of no level (or no token at all)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        inside = (ids >= 0) & (ids < len(self._level_of))
        return np.where(inside, self._level_of[np.clip(ids, 0, max(len(self._level_of) - 1, 0))], -1)

    def token_ids(self, level: int, indices) -> np.ndarray:
        """Code indices (e.g. OpenOneRec's ints, or build-ids' cluster numbers) at one level -> token IDs; -1
        where the level has no such code."""
        known, ids = self.level_indices[level], self.level_ids[level]
        idx = np.asarray(indices, dtype=np.int64)
        at = np.searchsorted(known, idx).clip(max=max(len(known) - 1, 0))
        return np.where((len(known) > 0) & (known[at] == idx), ids[at], -1)

    def check_codes(self, codes: np.ndarray, lengths: np.ndarray, item_ids, where="catalog") -> None:
        """Codes [N, levels] (token IDs, -1 past each row's length) against the layout: every row 1..levels tokens,
        token p of a code in level p. Raises CatalogError naming the first bad row and how many rows are bad."""
        n = len(lengths)
        if codes.shape[1] > self.levels:
            longest = int(np.argmax(lengths))
            raise CatalogError(
                where,
                f"column 'semantic_id', item {item_ids[longest]!r}: its code has {int(lengths[longest])} tokens; "
                f"this model's layout has {self.levels} levels",
            )
        short = np.flatnonzero(lengths < 1)
        if len(short):
            raise CatalogError(
                where, f"column 'semantic_id', item {item_ids[short[0]]!r}: empty code ({len(short)} rows affected)"
            )
        position = np.arange(codes.shape[1])[None, :]
        real = position < lengths[:, None]
        wrong = real & (self.level_of(codes) != position)
        bad = np.flatnonzero(wrong.any(axis=1))
        if not len(bad):
            return
        row = int(bad[0])
        pos = int(np.argmax(wrong[row]))
        token = int(codes[row, pos])
        level = int(self.level_of(token))
        what = "is not a semantic-ID token of this model" if level < 0 else f"belongs to level {level}"
        raise CatalogError(
            where,
            f"column 'semantic_id', item {item_ids[row]!r}: token {token} at position {pos} {what}, not level {pos} "
            f"({len(bad)} of {n} rows affected)",
        )

    def to_json(self, tokenizer) -> dict:
        """A `sid_layout.json` body that reads back to the same layout; levels as raw token IDs, so a sparse level's
        own code indices (which only a pid2sid import reads) are not kept."""

        def name(token_id):
            return None if token_id is None else tokenizer.convert_ids_to_tokens(int(token_id))

        body = {
            "version": LAYOUT_VERSION,
            "levels": [{"token_ids": ids.tolist()} for ids in self.level_ids],
            "begin": name(self.begin),
            "ending": self.ending_kind,
            "labels": list(self.labels),
        }
        if self.ending_kind == "end_token":
            body["end_token"] = name(self.ending[0])
        return body

    @classmethod
    def for_model(cls, model_dir: Path, tokenizer) -> SidLayout:
        path = Path(model_dir) / "genrec" / LAYOUT_FILE
        if not path.exists():
            return cls.infer(tokenizer)
        try:
            spec = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ModelDirectoryError(path, f"cannot be read as JSON ({err})") from None
        return cls.from_spec(spec, tokenizer, path)

    @classmethod
    def infer(cls, tokenizer) -> SidLayout:
        """OpenOneRec's naming when the vocabulary has `<s_a_N>` tokens and `<|sid_begin|>`, else genrec's `<a_N>`."""
        vocab = tokenizer.get_vocab()
        openonerec = SID_BEGIN in vocab and any(_name_match("s_", "a").match(t) for t in vocab)
        preset = "openonerec" if openonerec else "genrec"
        return cls.from_spec({"preset": preset}, tokenizer, f"the tokenizer ({preset} token names)")

    @classmethod
    def from_spec(cls, spec, tokenizer, where) -> SidLayout:
        """A `sid_layout.json` body's layout (docs/engine.md, 'The SID layout'); errors name `where` and the key."""
        if not isinstance(spec, dict):
            raise ModelDirectoryError(where, "must be a JSON object")
        unknown = sorted(set(spec) - _KEYS)
        if unknown:
            raise ModelDirectoryError(where, f"unknown keys {unknown} (known: {sorted(_KEYS)})")
        if spec.get("version", LAYOUT_VERSION) != LAYOUT_VERSION:
            raise ModelDirectoryError(where, f"version {spec['version']!r}: this genrec reads version {LAYOUT_VERSION}")
        preset = spec.get("preset")
        if preset is not None and preset not in PRESETS:
            raise ModelDirectoryError(where, f"preset {preset!r} is not one of {sorted(PRESETS)}")
        base = dict(PRESETS[preset]) if preset else {"begin": None, "ending": "none", "labels": ("yes", "no")}
        base.update({k: v for k, v in spec.items() if k in ("begin", "ending", "end_token", "labels")})
        vocab = tokenizer.get_vocab()
        if "levels" in spec:
            levels = _levels_from_spec(spec["levels"], vocab, where)
        elif preset:
            levels = _levels_by_name(base["name_prefix"], vocab, where)
        else:
            raise ModelDirectoryError(where, "needs 'levels' or a 'preset'")
        return cls(
            level_ids=tuple(ids for ids, _ in levels),
            level_indices=tuple(idx for _, idx in levels),
            begin=_named_token(base.get("begin"), vocab, where, "begin"),
            ending_kind=_ending_kind(base.get("ending"), where),
            ending=_ending_ids(base, tokenizer, where),
            labels=_labels(base.get("labels"), tokenizer, where),
            source=str(where),
        )


def _name_match(prefix: str, letter: str) -> re.Pattern:
    return re.compile(rf"^<{re.escape(prefix)}{letter}_(\d+)>$")


def _levels_by_name(prefix: str, vocab: dict[str, int], where) -> list[tuple[np.ndarray, np.ndarray]]:
    """Levels `<{prefix}a_N>`, `<{prefix}b_N>`, ... while the vocabulary has tokens of the next letter."""
    by_letter: dict[str, dict[int, int]] = {}
    name = re.compile(rf"^<{re.escape(prefix)}([a-z])_(\d+)>$")
    for token, token_id in vocab.items():
        match = name.match(token)
        if match:
            by_letter.setdefault(match.group(1), {})[int(match.group(2))] = token_id
    levels = []
    for letter in LETTERS:
        if letter not in by_letter:
            break
        levels.append(_sorted_level(by_letter.pop(letter)))
    if not levels:
        raise ModelDirectoryError(where, f"the vocabulary has no semantic-ID tokens named <{prefix}a_N>")
    if by_letter:
        raise ModelDirectoryError(
            where,
            f"semantic-ID tokens of letters {sorted(by_letter)} follow a missing letter "
            f"{LETTERS[len(levels)]!r} (levels must be a, b, c, ... without gaps)",
        )
    return levels


def _sorted_level(index_to_id: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
    indices = np.array(sorted(index_to_id), dtype=np.int64)
    return np.array([index_to_id[i] for i in indices.tolist()], dtype=np.int64), indices


def _levels_from_spec(levels, vocab: dict[str, int], where) -> list[tuple[np.ndarray, np.ndarray]]:
    if not isinstance(levels, list) or not levels:
        raise ModelDirectoryError(where, "'levels' must be a non-empty list, one entry per level")
    known = set(vocab.values())
    out = []
    for level, entry in enumerate(levels):
        key = f"levels[{level}]"
        if not isinstance(entry, dict) or len(entry) not in (1, 2):
            raise ModelDirectoryError(
                where, f"{key} must be one of {{pattern}}, {{tokens}}, {{token_ids}}, {{first_id, count}}"
            )
        if "pattern" in entry:
            out.append(_level_by_pattern(entry["pattern"], vocab, where, key))
        elif "tokens" in entry:
            names = entry["tokens"]
            missing = [t for t in names if t not in vocab] if isinstance(names, list) else [names]
            if missing or not names:
                raise ModelDirectoryError(where, f"{key}.tokens: {missing[:3] or 'empty'} not in the vocabulary")
            out.append(_by_position([vocab[t] for t in names], where, key))
        elif "token_ids" in entry:
            out.append(_by_position(_raw_ids(entry["token_ids"], known, where, f"{key}.token_ids"), where, key))
        elif set(entry) == {"first_id", "count"}:
            first, count = entry["first_id"], entry["count"]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (first, count)) or count < 1:
                raise ModelDirectoryError(where, f"{key}: first_id and count must be integers, count >= 1")
            ids = list(range(first, first + count))
            out.append(_by_position(_raw_ids(ids, known, where, key), where, key))
        else:
            raise ModelDirectoryError(where, f"{key}: unknown form {sorted(entry)}")
    return out


def _level_by_pattern(pattern, vocab, where, key) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(pattern, str) or pattern.count("{N}") != 1:
        raise ModelDirectoryError(where, f"{key}.pattern must be a string with one {{N}}, got {pattern!r}")
    head, tail = pattern.split("{N}")
    regex = re.compile(rf"^{re.escape(head)}(\d+){re.escape(tail)}$")
    found = {int(m.group(1)): token_id for token, token_id in vocab.items() if (m := regex.match(token))}
    if not found:
        raise ModelDirectoryError(where, f"{key}.pattern {pattern!r} matches no token of the vocabulary")
    return _sorted_level(found)


def _raw_ids(ids, known: set[int], where, key) -> list[int]:
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ModelDirectoryError(where, f"{key} must be a non-empty list of integer token IDs")
    missing = [i for i in ids if i not in known]
    if missing:
        raise ModelDirectoryError(where, f"{key}: token IDs {missing[:5]} are not in the tokenizer's vocabulary")
    return ids


def _by_position(ids: list[int], where, key) -> tuple[np.ndarray, np.ndarray]:
    if len(set(ids)) != len(ids):
        raise ModelDirectoryError(where, f"{key}: a token appears twice")
    return np.array(ids, dtype=np.int64), np.arange(len(ids), dtype=np.int64)


def _named_token(name, vocab: dict[str, int], where, key) -> int | None:
    if name is None:
        return None
    if not isinstance(name, str) or name not in vocab:
        raise ModelDirectoryError(where, f"{key}: {name!r} is not a token of the vocabulary")
    return vocab[name]


def _ending_kind(kind, where) -> str:
    if kind not in ENDINGS:
        raise ModelDirectoryError(where, f"ending: {kind!r} is not one of {list(ENDINGS)}")
    return kind


def _ending_ids(base: dict, tokenizer, where) -> tuple[int, ...]:
    kind = base.get("ending")
    if kind == "end_token":
        if base.get("end_token") is None:
            raise ModelDirectoryError(where, "ending 'end_token' needs 'end_token' (the token's name)")
        return (_named_token(base["end_token"], tokenizer.get_vocab(), where, "end_token"),)
    eos = tokenizer.eos_token_id
    if kind in ("eos", "newline_eos") and eos is None:
        raise ModelDirectoryError(where, f"ending {kind!r}: the tokenizer has no EOS token")
    if kind == "eos":
        return (eos,)
    if kind == "newline_eos":
        return (_one_token("\n", tokenizer, where, "ending '\\n'"), eos)
    return ()


def _labels(labels, tokenizer, where) -> tuple[str, str]:
    if not isinstance(labels, list | tuple) or len(labels) != 2 or not all(isinstance(w, str) for w in labels):
        raise ModelDirectoryError(where, f"labels must be two strings (positive, negative), got {labels!r}")
    ids = [_one_token(word, tokenizer, where, f"labels[{i}]") for i, word in enumerate(labels)]
    if ids[0] == ids[1]:
        raise ModelDirectoryError(where, f"labels {list(labels)} are the same token")
    return tuple(labels)


def _one_token(text: str, tokenizer, where, key) -> int:
    """The one token `text` is; a ModelDirectoryError naming `key` when it is none or several."""
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
    if len(tokens) != 1:
        raise ModelDirectoryError(where, f"{key}: {text!r} is not exactly one token (it tokenizes to {tokens})")
    return tokens[0]
