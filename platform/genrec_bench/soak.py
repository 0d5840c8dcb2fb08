"""`genrec bench soak`: memory of the Serve app's processes under bursts of mixed requests, to a steady state.

A local Serve app (its own Ray, HTTP on 127.0.0.1; an ingress, one engine replica, an embedding cache with no
backing store) receives `bursts` bursts of `burst` requests each, every kind the API answers: retrieve (token
IDs, text), score (item and text candidates), recommend and retrieve by a stored `user_id`, recommend by a
never-seen `user_id` (404), malformed or invalid bodies (400 / 422), and requests whose client hangs up early
(cancelled). Requests past the app's deadline come back 504 when a burst queues past it. After each burst has
been answered (and `settle_s` more), the resident set (VmRSS) of the ingress, engine, proxy and cache actor
processes is read from /proc (the replicas' PIDs from Ray's state API).

Reported: RSS per burst, each process's growth over the second half of the bursts and over each third of them
(least-squares slopes, MB per 1,000 requests), whether it plateaued (second half's slope under `plateau_mb_per_1k`)
and a steady-state verdict: steady (the last third under it), slowing (the last third at under half the first
third's rate: a curve that flattens, warm-up or allocator fragmentation) or growing (a straight line: a leak).
The engine's KV pool is allocated uninitialised: its pages become resident as requests first write them, up to
the pool's size (and the prefix cache keeps up to `prefix_cache_bytes` of it by design), so the pool is sized
small here and said in the report; growth that stops within it is not a leak. The run stops by itself after the
bursts or `max_seconds`. The Ray it starts inherits the command's environment: `MALLOC_ARENA_MAX=2 genrec bench
soak` caps glibc's malloc arenas in every process (the ingress's and proxy's residual growth is arena retention).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections import Counter

import httpx
import numpy as np
import torch

from genrec.engine import Engine
from genrec.errors import GenrecError
from genrec_bench.app import app_args, deploy, local_serve
from genrec_bench.cli import SoakOptions
from genrec_bench.common import decoder, described, machine, model_dir_for, random_prompt

APP = "soak"
WORDS = "user listened to comedy podcast episode news show jazz album movie thriller drama late night".split()
# The options a report repeats, in its order.
SETTINGS = (
    "burst concurrency prompt_len beam_width candidates kv_budget_bytes prefix_cache_bytes request_timeout_s".split()
)
KNOWN_USERS = 64  # users with a stored embedding (recommend / retrieve by user_id)
PROCESSES = ("Ingress", "EngineServer", "ProxyActor", "EmbeddingCacheActor")
# One request of each kind per cycle; weights by repetition: mostly valid traffic, some refusals and hang-ups.
MIX = tuple(
    "retrieve_tokens retrieve_text score_items score_text recommend_user retrieve_user retrieve_tokens score_items "
    "recommend_inline recommend_unknown_user invalid_field malformed_json cancelled recommend_user".split()
)


def run(o: SoakOptions) -> dict:
    model_dir = model_dir_for(o.preset, o.model, None)
    engine = Engine.from_pretrained(model_dir)
    parts = decoder(engine)
    if getattr(parts, "trie", None) is None:  # a ranking model
        raise ValueError("the soak sends retrieve, score and recommend requests: use a Qwen3 model")
    user_dim = parts.projector.user_dim if parts.projector is not None else None
    maker = SoakRequests(engine, o, user_dim)
    del engine
    started = time.monotonic()
    with _local_app(model_dir, o, user_dim) as (url, pids):
        samples = asyncio.run(_soak(url, pids, maker, o, started + o.max_seconds))
    return {
        "benchmark": "soak",
        **described(model_dir, o),
        "bursts_planned": o.bursts,
        **{k: getattr(o, k) for k in SETTINGS},
        "seconds": time.monotonic() - started,
        "stopped_by_time": len(samples) - 1 < o.bursts,
        "pids": pids,
        **summarize(samples, o.plateau_mb_per_1k),
        "note": "RSS in MB (VmRSS) after each burst is answered; slope: least squares over the second half of the "
        "bursts, MB per 1,000 requests (also per third of the bursts); plateaued: slope < plateau_mb_per_1k; "
        "steady_state: steady (last third < plateau_mb_per_1k), slowing (last third < half the first third), "
        "growing (a straight line). The engine's KV pool (kv_budget_bytes) becomes resident as it is first "
        "written: growth within it is by design",
        "machine": machine(),
    }


class SoakRequests:
    """The i-th request of the soak: (kind, path, body, client timeout). Prompts are random (unique: the prefix
    cache fills and evicts), user IDs of the unknown kind never repeat (per-key state would show)."""

    def __init__(self, engine, o: SoakOptions, user_dim: int | None, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.prompt_len, self.beam_width, self.candidates, self.user_dim = (
            o.prompt_len,
            o.beam_width,
            o.candidates,
            user_dim,
        )
        # What the requests need from the engine, kept without the engine itself (the driver drops it).
        self.prompts = [random_prompt(engine, o.prompt_len, self.generator) for _ in range(256)]
        self.item_ids = list(engine.catalog.item_ids[: min(len(engine.catalog), 4096)])
        self.count = 0

    def _prompt_ids(self) -> list[int]:
        base = self.rng.choice(self.prompts)
        return [self.rng.choice(base) for _ in base]  # a fresh prompt from the base's tokens

    def _text(self, words: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(words))

    def _items(self) -> list[dict]:
        """Distinct catalog items (a score refuses an item given twice)."""
        picked = self.rng.sample(self.item_ids, min(self.candidates, len(self.item_ids)))
        return [{"item_id": item} for item in picked]

    def _user_prompt(self) -> str:
        return f"user <|user|> {self._text(self.prompt_len // 2)}"

    def __call__(self) -> tuple[str, str, object, float | None]:
        self.count += 1
        kind = MIX[self.count % len(MIX)]
        if kind == "recommend_user" and self.user_dim is None:
            kind = "retrieve_tokens"
        known = f"soak-user-{self.rng.randrange(KNOWN_USERS)}"
        width = self.beam_width
        if kind == "retrieve_tokens":
            return kind, "retrieve", {"prompt_token_ids": self._prompt_ids(), "beam_width": width}, None
        if kind == "retrieve_text":
            return kind, "retrieve", {"prompt": self._text(self.prompt_len // 2), "beam_width": width}, None
        if kind == "score_items":
            return kind, "score", {"prompt_token_ids": self._prompt_ids(), "candidates": self._items()}, None
        if kind == "score_text":
            texts = [{"text": self._text(4)} for _ in range(max(1, self.candidates // 4))]
            return kind, "score", {"prompt": self._text(self.prompt_len // 2), "candidates": texts}, None
        if kind in ("recommend_user", "retrieve_user") and self.user_dim is not None:
            route = kind.split("_")[0]
            body = {"prompt": self._user_prompt(), "user_id": known, "beam_width": width, "num_results": 5}
            if route == "recommend":
                body["candidates"] = self._items()[:4]
            return kind, route, body, None
        if kind == "recommend_inline" and self.user_dim is not None:
            vector = [self.rng.uniform(-1, 1) for _ in range(self.user_dim)]
            body = {"prompt": self._user_prompt(), "user_embedding": vector, "beam_width": width}
            return kind, "recommend", body, None
        if kind == "recommend_unknown_user":
            body = {"prompt": self._user_prompt(), "user_id": f"soak-unknown-{self.count}", "beam_width": width}
            return kind, "recommend", body, None
        if kind == "invalid_field":
            bad = self.rng.choice(
                [{"beam_width": 0}, {"no_such_field": 1}, {"num_results": -1}, {"user_id": True}, {"prompt": ""}]
            )
            return kind, "retrieve", {"prompt_token_ids": self._prompt_ids()[:8], **bad}, None
        if kind == "malformed_json":
            return kind, "retrieve", b'{"prompt": "user listened to', None
        if kind == "cancelled":  # the client hangs up before the answer: Serve cancels the request
            body = {"prompt_token_ids": self._prompt_ids(), "beam_width": width * 2}
            return kind, "retrieve", body, 0.005
        return kind, "retrieve", {"prompt_token_ids": self._prompt_ids(), "beam_width": width}, None


async def _soak(url, pids, maker, o: SoakOptions, deadline) -> list[dict]:
    limits = httpx.Limits(max_connections=o.concurrency + 8, max_keepalive_connections=o.concurrency + 8)
    samples = [{"burst": 0, "requests": 0, "seconds": 0.0, "rss_mb": rss_mb(pids), "statuses": {}}]
    sent = 0
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        slots = asyncio.Semaphore(o.concurrency)

        async def one(kind, route, body, timeout_s) -> str:
            async with slots:
                try:
                    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
                    if isinstance(body, bytes):
                        kw["headers"] = {"content-type": "application/json"}
                    response = await client.post(f"{url}/v1/{route}", timeout=timeout_s or 120, **kw)
                    return str(response.status_code)
                except httpx.TimeoutException:
                    return "client_timeout" if timeout_s else "client_timeout_unexpected"
                except httpx.HTTPError as err:
                    return f"http_error:{type(err).__name__}"

        for n in range(1, o.bursts + 1):
            if time.monotonic() > deadline:
                break
            start = time.monotonic()
            requests = [maker() for _ in range(o.burst)]
            statuses = await asyncio.gather(*(one(*r) for r in requests))
            sent += o.burst
            await asyncio.sleep(o.settle_s)
            by_kind = Counter(f"{r[0]}:{s}" for r, s in zip(requests, statuses, strict=True))
            samples.append(
                {
                    "burst": n,
                    "requests": sent,
                    "seconds": time.monotonic() - start,
                    "rss_mb": rss_mb(pids),
                    "statuses": dict(sorted(Counter(statuses).items())),
                    "by_kind": dict(sorted(by_kind.items())),
                }
            )
    return samples


def rss_mb(pids: dict[str, int]) -> dict[str, float | None]:
    """Each process's VmRSS in MB (None once it is gone)."""
    out = {}
    for name, pid in pids.items():
        try:
            with open(f"/proc/{pid}/status") as f:
                line = next(line for line in f if line.startswith("VmRSS:"))
            out[name] = int(line.split()[1]) / 1024
        except (OSError, StopIteration):
            out[name] = None
    return out


def slope_per_1k(requests: list[int], values: list[float]) -> float | None:
    """Least-squares slope of values against requests, per 1,000 requests (None under two points)."""
    if len(values) < 2 or len(set(requests)) < 2:
        return None
    return float(np.polyfit(np.asarray(requests, float), np.asarray(values, float), 1)[0] * 1000)


def summarize(samples: list[dict], plateau_mb_per_1k: float) -> dict:
    """Per process: RSS at the start, after the first burst, the middle and the end; the slope over the second
    half of the bursts and over each third; plateaued or not, and a steady-state verdict. Statuses over the run."""
    after = samples[1:]
    half = after[len(after) // 2 :] if len(after) >= 4 else after
    processes = {}
    for name in samples[0]["rss_mb"]:
        series = [(s["requests"], s["rss_mb"][name]) for s in samples if s["rss_mb"][name] is not None]
        second = [(r, v) for r, v in series if r >= (half[0]["requests"] if half else 0)]
        slope = slope_per_1k([r for r, _ in second], [v for _, v in second])
        thirds = slopes_by_third([(r, v) for r, v in series if r > 0])
        values = [v for _, v in series]
        processes[name] = {
            "rss_start_mb": values[0] if values else None,
            "rss_after_first_burst_mb": values[1] if len(values) > 1 else None,
            "rss_mid_mb": values[len(values) // 2] if values else None,
            "rss_end_mb": values[-1] if values else None,
            "rss_max_mb": max(values) if values else None,
            "second_half_mb_per_1k_requests": slope,
            "thirds_mb_per_1k_requests": thirds,
            "plateaued": slope is not None and slope < plateau_mb_per_1k,
            "steady_state": steady_state(thirds, plateau_mb_per_1k),
        }
    totals: Counter = Counter()
    for s in after:
        totals.update(s.get("by_kind", {}))
    return {
        "bursts": len(after),
        "requests": after[-1]["requests"] if after else 0,
        "plateau_mb_per_1k": plateau_mb_per_1k,
        "processes": processes,
        "plateaued": all(p["plateaued"] for p in processes.values() if p["rss_end_mb"] is not None),
        "steady_state": {name: p["steady_state"] for name, p in processes.items()},
        "answers": dict(sorted(totals.items())),
        "per_burst": [
            {"burst": s["burst"], "requests": s["requests"], "seconds": round(s["seconds"], 2), **s["rss_mb"]}
            for s in samples
        ],
    }


def slopes_by_third(series: list[tuple[int, float]]) -> list[float | None]:
    """The least-squares slope (MB per 1,000 requests) over the first, middle and last third of the bursts (each
    third shares its first point with the previous one's last); [] under six bursts."""
    if len(series) < 6:
        return []
    cuts = [round(i * (len(series) - 1) / 3) for i in range(4)]
    return [
        slope_per_1k([r for r, _ in series[a : b + 1]], [v for _, v in series[a : b + 1]])
        for a, b in zip(cuts, cuts[1:], strict=False)
    ]


def steady_state(thirds: list[float | None], plateau_mb_per_1k: float) -> str:
    """ "steady": the last third grows under `plateau_mb_per_1k`; "slowing": it still grows, at under half the
    first third's rate (warm-up or fragmentation settling); "growing": steadily (a leak's straight line);
    "too_short": under six bursts."""
    if len(thirds) < 3 or any(t is None for t in thirds):
        return "too_short"
    first, last = thirds[0], thirds[-1]
    if last < plateau_mb_per_1k:
        return "steady"
    return "slowing" if last < 0.5 * first else "growing"


def replica_pids(app: str) -> dict[str, int]:
    """PIDs of the app's ingress and engine replica, Serve's proxy and the cache actor, from the GCS's actor
    table of this Ray (the state API's list_actors needs the dashboard, which the bench does not start)."""
    from ray._private import state

    pids = {}
    for actor in state.actors(actor_state_name="ALIVE").values():
        cls, pid = actor.get("ActorClassName") or "", actor.get("Pid")
        for name in PROCESSES:
            if pid and cls.endswith(name) and (name in ("ProxyActor", "EmbeddingCacheActor") or f":{app}:" in cls):
                pids.setdefault(_label(name), pid)
    missing = [_label(n) for n in PROCESSES if _label(n) not in pids]
    if missing:
        raise GenrecError(f"no live process found for {missing} among this Ray's actors")
    return pids


def _label(name: str) -> str:
    return {"Ingress": "ingress", "EngineServer": "engine", "ProxyActor": "proxy"}.get(name, "cache")


@contextlib.contextmanager
def _local_app(model_dir, o: SoakOptions, user_dim: int | None):
    """The app on a local Ray of its own, with an embedding cache holding the known users' vectors when the model
    takes one; yields (URL, process IDs)."""
    from genrec.cache.actor import EmbeddingCache
    from genrec.cache.config import CacheConfig

    cache = CacheConfig(name=f"soak-{os.getpid()}", dim=user_dim or 1, store="none", capacity=10_000)
    args = app_args(
        model_dir,
        kv_budget_bytes=o.kv_budget_bytes,
        prefix_cache_bytes=o.prefix_cache_bytes,
        timeout_s=o.request_timeout_s,
        cache=cache if user_dim else None,
    )
    with local_serve() as base:
        if user_dim:
            vectors = np.random.default_rng(0).standard_normal((KNOWN_USERS, user_dim)).astype(np.float32)
            EmbeddingCache.connect(cache).put([f"soak-user-{i}" for i in range(KNOWN_USERS)], vectors)
        url = deploy(base, APP, args)
        yield url, replica_pids(APP)
