"""A few real HTTP requests to the Serve app (retrieve, score, recommend by user_id, and the two-stage recommend
with the user's history), shown as movie titles."""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import numpy as np

from genrec.errors import GenrecError
from genrec_demo.data import MovieLens
from genrec_demo.pipeline.inputs import Prompts

SHOW = 5  # titles per list


@dataclass(frozen=True)
class Funnel:
    window: int  # the ranker's history: the user's last events
    task: str  # the ranker's task that orders the items


@dataclass
class Latencies:
    ms: dict[str, list[float]] = field(default_factory=dict)

    def add(self, route: str, seconds: float) -> None:
        self.ms.setdefault(route, []).append(seconds * 1000)

    def summary(self) -> dict[str, str]:
        return {
            f"POST /v1/{route}": f"median {np.median(v):.0f} ms, max {max(v):.0f} ms ({len(v)} requests)"
            for route, v in self.ms.items()
        }


def post(base_url: str, path: str, body: dict, latencies: Latencies, timeout_s: float = 120.0, route=None) -> dict:
    """POST /v1/<path>; its latency is counted under `route` (default: the path)."""
    request = urllib.request.Request(
        f"{base_url}/v1/{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as err:
        raise GenrecError(f"POST /v1/{path} answered {err.code}: {err.read().decode(errors='replace')}") from None
    latencies.add(route or path, time.perf_counter() - started)
    return answer


def user_body(data: MovieLens, prompts: Prompts, u: int) -> dict:
    """What every request about user u says: who (the soft token's vector is looked up by user_id), their prompt,
    and the movies they have seen (excluded)."""
    seen = data.seen_before_test(u)
    return {
        "user_id": data.user_ids[u],  # the ingress looks the soft-token vector up in the EmbeddingCache actor
        "prompt": prompts.text(seen),
        "exclude_item_ids": [data.item_ids[i] for i in seen],
    }


def show_user(
    base_url, data: MovieLens, prompts: Prompts, titles: dict[str, str], u: int, latencies, say, ranking, funnel: Funnel
):
    """The user's last watched titles, then what retrieve, recommend (ranked as `ranking` says: rank_by and
    score_weight), the two-stage recommend (the same beams ordered by the HSTU ranker) and score answer for
    them (by user_id)."""
    seen = data.seen_before_test(u)
    user = user_body(data, prompts, u)
    latest = "; ".join(titles[data.item_ids[i]] for i in seen[-SHOW:][::-1])
    say(f"\nuser {data.user_ids[u]}, last watched (latest first): {latest}")
    retrieved = post(base_url, "retrieve", {**user, "beam_width": 50, "num_results": SHOW}, latencies)
    say("  retrieve  (beam log-prob):   " + _titles(retrieved["items"], titles, "logprob"))
    recommended = post(base_url, "recommend", {**user, **ranking, "beam_width": 50, "num_results": 50}, latencies)
    say("  recommend (reranked, P(yes)):" + _titles(recommended["items"][:SHOW], titles, "score_logprob", _percent))
    events = data.events(u, len(seen), funnel.window)
    two_stage = {**user, "beam_width": 50, "num_results": SHOW, "history": events, "rank_task": funnel.task}
    ranked = post(base_url, "recommend", two_stage, latencies, route="recommend (two-stage)")
    say(f"  funnel    (HSTU, P({funnel.task})): " + "; ".join(_ranked(ranked["items"], titles, funnel.task)))
    held_out = data.item_ids[data.test(u)]
    popular = [data.item_ids[i] for i in np.argsort(-data.popularity, kind="stable") if i not in set(seen)][:3]
    candidates = [held_out, *[p for p in popular if p != held_out]][:4]
    score = {k: user[k] for k in ("user_id", "prompt")} | {"candidates": [{"item_id": c} for c in candidates]}
    scored = post(base_url, "score", score, latencies)["scores"]
    marks = {c: "held-out next movie" if c == held_out else "popular, unseen" for c in candidates}
    shown = [f"{titles[s['item_id']]} [{marks[s['item_id']]}] ({_percent(s['logprob'])})" for s in scored]
    say("  score     (P(yes)):          " + "; ".join(shown))


# Filters the demo shows: each masks the beam search itself (only such movies ever take a beam).
FILTERS = {"comedies": {"genres": "Comedy"}, "1980s": {"decade": 1980}}


def show_filters(base_url: str, user: dict, titles: dict[str, str], latencies, say) -> dict[str, dict]:
    """The user's retrieve restricted by each of FILTERS: the answer's items by name (and its catalog version)."""
    shown = {}
    for name, filters in FILTERS.items():
        body = {**user, "beam_width": 50, "num_results": SHOW, "filters": filters}
        answer = post(base_url, "retrieve", body, latencies, route="retrieve (filtered)")
        say(f"  retrieve, filters {json.dumps(filters)}: " + "; ".join(titles[i["item_id"]] for i in answer["items"]))
        shown[name] = {"filters": filters, "items": [i["item_id"] for i in answer["items"]]}
    return shown


def _titles(items: list[dict], titles: dict[str, str], value: str, shown=lambda v: f"{v:.2f}") -> str:
    return "; ".join(f"{titles[i['item_id']]} ({shown(i[value])})" for i in items)


def _ranked(items: list[dict], titles: dict[str, str], task: str) -> list[str]:
    return [f"{titles[i['item_id']]} ({100 * i['ranker_scores'][task]:.2g}%)" for i in items if i["ranker_scores"]]


def _percent(logprob: float) -> str:
    """P(yes) as a percentage: trained as a noise-contrastive classifier, it is about P(next item), small."""
    return f"{100 * math.exp(logprob):.2g}%"
