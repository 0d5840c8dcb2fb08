"""Route each user's requests to the engine replica that holds their prompts' K/V (docs/serving.md, "Routing each
user to one replica"). The key (`routing_key`, passed by the ingress as a keyword of its handle call): the user ID,
else a digest of the first `blocks` blocks of what the engine is sent; the ingress has no tokenizer, so a text's or
chat's first block is approximated by its first characters. Rendezvous hashing: the highest hash(key, replica ID)
is the primary, the next the fallback; a replica refusing for want of its declared catalog is ranked last.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Iterable

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

ROUTING_KEY = "routing_key"  # the keyword argument of the engine deployment's methods that carries the key
USER_ROUTER = f"{__name__}:UserRouter"
SPILL_AFTER_S = 0.1

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
    if getattr(body, "messages", None) is not None:  # the first characters of the conversation, roles included
        chat = "".join(f"{m.role}\0{m.content}\0" for m in body.messages)
        return "chat:" + chat[: FIRST_TEXT_CHARS * blocks]
    return "text:" + (body.prompt or "")[: FIRST_TEXT_CHARS * blocks]


def score(key: str, replica_id: str) -> int:
    """The replica's rendezvous weight: a stable 64-bit hash (Python's hash() differs per process)."""
    digest = hashlib.blake2b(f"{key}\0{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, replica_ids: Iterable[str]) -> list[str]:
    """The replica IDs, best first for this key, whatever order they are given in."""
    return sorted(replica_ids, key=lambda rid: (score(key, rid), rid), reverse=True)


def ranks(key: str, replicas: list, replica_id=lambda r: r, widen: int = 2) -> list[list]:
    """[[primary], [fallback], [the rest]], the first `widen` + 1 of them, empty ones left out."""
    by_id = {replica_id(r): r for r in replicas}
    ordered = [by_id[rid] for rid in rendezvous_order(key, by_id)]
    return [rank for rank in (ordered[:1], ordered[1:2], ordered[2:])[: widen + 1] if rank]


def widening(waited_s: float, spill_after_s: float) -> int:
    """0 (the primary only), 1 (the fallback too) after `spill_after_s`, 2 (any replica) after twice that."""
    return min(2, int(waited_s // spill_after_s)) if spill_after_s > 0 else 2


class UserRouter(RequestRouter):
    """Ranks by `ranks`; a request without a key goes to two random replicas (as Serve's default does)."""

    spill_after_s = SPILL_AFTER_S

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._publish()

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._publish()

    def _publish(self) -> None:
        # Imported here: Serve ships this class to its callers by value, so a global of this module read by its
        # methods would be a copy of the one the process's other code reads.
        from genrec.serving.replicas import publish_live

        ids = frozenset(replica_id.unique_id for replica_id in self.curr_replicas)
        publish_live(self.app_name, self._deployment_id.name, ids)

    def initialize_state(self, spill_after_s: float = SPILL_AFTER_S) -> None:
        """`request_router_kwargs` (an unknown keyword fails the router's start instead of vanishing)."""
        if isinstance(spill_after_s, bool) or not isinstance(spill_after_s, int | float) or spill_after_s < 0:
            raise ValueError(f"spill_after_s must be a number of seconds >= 0, not {spill_after_s!r}")
        self.spill_after_s = float(spill_after_s)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        serving, refusing = by_catalog(candidate_replicas)
        if pending_request is None:
            return [random.sample(serving, min(2, len(serving)))]
        # When no rank offered accepts, Serve calls again after a backoff sleep; the ranks widen with the wait, so a
        # busy primary is retried for a while before the request spills to the fallback (which serves it cold).
        pending_request.routing_context.should_backoff = True
        key = pending_request.kwargs.get(ROUTING_KEY)
        widen = widening(time.time() - pending_request.created_at, self.spill_after_s)
        if not isinstance(key, str) or not key:
            chosen = [random.sample(serving, min(2, len(serving)))]
        else:
            chosen = ranks(key, serving, lambda r: r.replica_id.unique_id, widen)
        return chosen + [refusing] if refusing and widen == 2 else chosen


def by_catalog(replicas: list) -> tuple[list, list]:
    """(the replicas that serve their declared catalog, those refusing for want of it); when none serves it, all
    are taken as serving (ranked as ever: each answers 503 until it does)."""
    refusing = [r for r in replicas if r.routing_stats.get("catalog_served") is False]
    if len(refusing) == len(replicas):
        return replicas, []
    return [r for r in replicas if r.routing_stats.get("catalog_served") is not False], refusing
