"""A request's routing key: what sends it to the engine replica that already holds its K/V (see router.py).

The user ID when the request has one. Without one, a digest of the prompt's first block (by default): a
returning user's prompt starts like their last one (history first, oldest first: docs/engine.md, "Prompt layouts
that reuse"), so it still finds the replica that holds it. The ingress has no tokenizer, so a text prompt's first
block is approximated by its first characters. Prompts that all open with the same template would all share
that key (one replica's traffic): with `blocks` (the app's `routing_prefix_blocks`) the digest covers the first
`blocks` blocks, template included, so prompts that differ after it get their own keys.

A two-stage recommend calls two deployments: both get the user's key; without a user, each the digest of what
it is sent (the retriever the prompt, the ranker the history), so each lands where that input's K/V is.
"""

from __future__ import annotations

import hashlib
import json

FIRST_BLOCK = 16  # tokens (or history events) of one prefix-cache block (genrec.engine.prefix_cache.BLOCK)
FIRST_TEXT_CHARS = 64  # a text prompt's first characters: roughly its first block


def routing_key(body, sent=None, blocks: int = 1) -> str:
    """`sent`: the request the engine gets, when its first block is not the body's (default: the body);
    `blocks`: how many of its first blocks a key without a user ID digests."""
    user_id = getattr(body, "user_id", None)
    if user_id is not None:
        return f"user:{user_id!r}"  # repr: the user 42 and the user "42" are two keys, as in the cache
    first = _first_blocks(body if sent is None else sent, blocks)
    return "prefix:" + hashlib.blake2b(first.encode(), digest_size=16).hexdigest()


def _first_blocks(body, blocks: int) -> str:
    history = getattr(body, "history", None)
    if history is not None:  # a rank request: its first events
        return json.dumps([[e.item_id, e.action, e.timestamp] for e in history[: FIRST_BLOCK * blocks]])
    if getattr(body, "prompt_token_ids", None) is not None:
        return json.dumps(list(body.prompt_token_ids[: FIRST_BLOCK * blocks]))
    return "text:" + (body.prompt or "")[: FIRST_TEXT_CHARS * blocks]
