"""`genrec bench isolation`: the prefix cache as a timing side channel across users, measured by wall time.

Victims' prompts (a retriever) or histories (a ranker) are served, each in its user's cache scope. Another user then
tries guesses, half of them right (a victim's exact prompt or history), half wrong (new ones), in random order, each
timed once, and calls a guess "served for someone" when it is answered faster than a threshold. The threshold is the
attacker's own calibration, just before its guesses: the geometric mean of its cold and its warm times (a new prompt
of its own, then the same again, in its own scope). One-try accuracy is the share of guesses called right: 0.5 is
chance.

The guesses are tried three ways: in the attacker's own scope and with no scope (what isolation must hold: chance),
and in the victim's own scope (the control: what a content-only cache gave anyone, and what an unauthenticated
caller who sends the victim's user_id still gets over HTTP).
"""

from __future__ import annotations

import math
import random
import statistics

import torch

from genrec.api import RetrieveRequest
from genrec.engine import Engine
from genrec_bench.cli import IsolationOptions
from genrec_bench.common import hstu_preset_dir, machine, model_dir_for, random_prompt, timed
from genrec_bench.engine import rank_request

GOAL = 0.6  # across users, one-try accuracy at most this (chance is 0.5)
ATTACKER = "user:attacker"


def run(o: IsolationOptions) -> dict:
    retriever = Engine.from_pretrained(model_dir_for(o.preset, None, None), device=o.device)  # the cache on
    ranker = Engine.from_pretrained(hstu_preset_dir(o.preset), device=o.device)
    families = {
        "retriever": _Retrieves(retriever, o.prompt_len, o.beam_width),
        "ranker": _Ranks(ranker, o.events, o.candidates),
    }
    report = {name: side_channel(family, o.guesses, o.calibration, o.device) for name, family in families.items()}
    worst = max(report[name][mode]["accuracy"] for name in families for mode in ("own_scope", "no_scope"))
    return {
        "benchmark": "isolation",
        "preset": o.preset,
        "prompt_len": o.prompt_len,
        "beam_width": o.beam_width,
        "history_events": o.events,
        "guesses": o.guesses,
        **report,
        "cross_user_accuracy_max": worst,
        "goals": {"cross_user_accuracy_max": f"<= {GOAL}"},
        "machine": machine(),
    }


class _Retrieves:
    """Prompts of ordinary tokens, served by a Qwen3 engine's retrieve."""

    def __init__(self, engine: Engine, prompt_len: int, beam_width: int):
        self.engine, self.prompt_len, self.beam_width = engine, prompt_len, beam_width
        self.generator = torch.Generator().manual_seed(0)

    def new(self):
        return random_prompt(self.engine, self.prompt_len, self.generator)

    def serve(self, context, scope: str | None) -> None:
        request = RetrieveRequest(prompt_token_ids=context, beam_width=self.beam_width, cache_scope=scope)
        self.engine.retrieve([request])


class _Ranks:
    """Histories of the ranker's items, served by an HSTU engine's rank."""

    def __init__(self, engine: Engine, events: int, candidates: int):
        self.engine, self.events, self.candidates = engine, events, candidates
        self.seed = 0

    def new(self):
        self.seed += 1
        return rank_request(self.engine, self.events, self.candidates, seed=self.seed)

    def serve(self, context, scope: str | None) -> None:
        self.engine.rank([context.model_copy(update={"cache_scope": scope})])


def side_channel(family, guesses: int, calibration: int, device: str) -> dict:
    """One-try accuracy of the timing test in each way of guessing, and the times it saw."""
    _calibrate(family, 2, device)  # warm-up
    out = {}
    for mode in ("own_scope", "no_scope", "victims_scope"):
        threshold, calibrated = _calibrate(family, calibration, device)  # close in time to the guesses
        victims = [(f"user:victim-{mode}-{i}", family.new()) for i in range(guesses // 2)]
        for scope, context in victims:
            family.serve(context, scope)
        tries = [(context, True, scope) for scope, context in victims]
        tries += [(family.new(), False, None) for _ in range(guesses - len(victims))]
        random.Random(len(tries)).shuffle(tries)
        times = []
        for context, right, victim in tries:
            scope = {"own_scope": ATTACKER, "no_scope": None}.get(mode, victim if right else ATTACKER)
            times.append((timed(lambda c=context, s=scope: family.serve(c, s), device), right))
        said = [(seconds < threshold) == right for seconds, right in times]
        right_s = [s for s, r in times if r]
        wrong_s = [s for s, r in times if not r]
        out[mode] = {
            "accuracy": sum(said) / len(said),
            "threshold_s": threshold,
            "calibration": calibrated,
            "right_guess_median_s": statistics.median(right_s),
            "wrong_guess_median_s": statistics.median(wrong_s),
            "wrong_over_right": statistics.median(wrong_s) / statistics.median(right_s),
        }
    return out


def _calibrate(family, n: int, device: str) -> tuple[float, dict]:
    """The attacker's threshold: between its own cold and warm times (a new context, then the same again)."""
    cold, warm = [], []
    for _ in range(n):
        context = family.new()
        cold.append(timed(lambda c=context: family.serve(c, ATTACKER), device))
        warm.append(timed(lambda c=context: family.serve(c, ATTACKER), device))
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    return math.sqrt(cold_s * warm_s), {"cold_s": cold_s, "warm_s": warm_s, "cold_over_warm": cold_s / warm_s}
