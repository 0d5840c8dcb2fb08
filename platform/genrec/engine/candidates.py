"""Turn scoring inputs (candidates, labels) into token IDs, with errors that name the field."""

from __future__ import annotations

from genrec.api import Candidate
from genrec.engine.prompts import check_text_fits
from genrec.errors import InvalidRequestError


def candidate_token_lists(engine, candidates: list[Candidate], prompt_tokens: int) -> list[list[int]]:
    if len(candidates) > engine.max_candidates:
        raise InvalidRequestError(
            "candidates", f"{len(candidates)} candidates exceed this engine's limit of {engine.max_candidates}"
        )
    vocab = engine.model.config.vocab_size
    room = engine.model.config.max_position_embeddings - prompt_tokens
    lists, total = [], 0
    for i, cand in enumerate(candidates):
        field = f"candidates[{i}]"
        if cand.item_id is not None:
            index = engine.catalog.index_of(cand.item_id)
            if index is None:
                raise InvalidRequestError(f"{field}.item_id", f"unknown item {cand.item_id!r}")
            tokens = engine.catalog.codes[index].tolist()
        elif cand.text is not None:
            check_text_fits(f"{field}.text", cand.text, room)
            tokens = engine.tokenizer(cand.text, add_special_tokens=False)["input_ids"]
            if not tokens:
                raise InvalidRequestError(f"{field}.text", "tokenizes to no tokens")
        else:
            tokens = cand.token_ids
            bad = [t for t in tokens if t >= vocab]
            if bad:
                raise InvalidRequestError(f"{field}.token_ids", f"token IDs {bad[:5]} are outside the vocabulary")
        if len(tokens) > room:
            raise InvalidRequestError(
                field, f"prompt plus candidate exceed the model's {room + prompt_tokens} positions"
            )
        total += len(tokens)
        if total > engine.max_candidate_tokens:  # checked as it goes: the rest is never tokenized
            raise InvalidRequestError(
                "candidates", f"more than this engine's limit of {engine.max_candidate_tokens} candidate tokens in all"
            )
        lists.append(tokens)
    return lists


def label_token_ids(tokenizer, labels: tuple[str, str]) -> tuple[int, int]:
    ids = []
    for i, label in enumerate(labels):
        tokens = tokenizer(label, add_special_tokens=False)["input_ids"] if label else []
        if len(tokens) != 1:
            raise InvalidRequestError(
                f"labels[{i}]", f"{label!r} is not a single token in the vocabulary (it tokenizes to {tokens})"
            )
        ids.append(tokens[0])
    if ids[0] == ids[1]:
        raise InvalidRequestError("labels", "the positive and negative labels are the same token")
    return ids[0], ids[1]
