"""Serve's autoscaling on the work the engine replicas hold, not on their request count (docs/serving.md,
"Autoscaling on work").

One request of beam 1,024 over a 5,000-token prompt costs the engine about a hundred requests of beam 8 over 100
tokens, yet Serve's default policy counts each as one ongoing request. Here every engine replica reports the work
queued and running in its engine (`EngineServer.record_autoscaling_stats`: `Scheduler.work_in_flight`, in the
engine's token-equivalents) and `WorkPolicy` asks for as many replicas as that work fills at the config's target
per replica.

`WorkPolicy` runs in Serve's controller, which loads it by value from the config's import path: this module
imports neither torch nor the engine, and its policy refers to nothing outside it but the standard library.
Serve 2.60 wraps every policy, this one included, in its delay logic (`upscale_delay_s`, `downscale_delay_s`,
`downscale_to_zero_delay_s`, kept in the policy state under Serve's own keys) and its scaling factors, so the
delays behave as they do for the default policy; this policy returns its own state beside them.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

# What an engine replica reports (`record_autoscaling_stats`) and the policy reads from `aggregated_metrics`.
WORK_METRIC = "genrec_work_in_flight"
# A config's `autoscaling_config.policy.policy_function`.
WORK_POLICY = "genrec.serving.autoscaling:WorkPolicy"
# Under Serve's logger, so each decision lands in the controller's log (logs/serve/controller_*.log).
log = logging.getLogger("ray.serve.genrec_autoscaling")

_LAST = "genrec_replicas"  # the policy state's key: the decision of the previous tick, to log only changes


class WorkPolicy:
    """Replicas = the deployment's work / `target_work_per_replica`, rounded up, within the capacity-adjusted
    min and max replicas (KubeRay's incremental upgrade moves them through `target_capacity`).

    `policy_kwargs`, in the unit the engines report (`Scheduler.work_of`; how to choose them: docs/serving.md,
    "Autoscaling on work"):
    - `target_work_per_replica`: the work one replica should hold.
    - `work_per_request` (default 0): a fixed cost added per ongoing request (Serve's count, queued at handles
      too), for an engine whose per-request overhead is large next to its requests' work.

    The work is each replica's report averaged over `look_back_period_s` (Serve's `aggregation_function`), summed
    over the running replicas. Until some replica has reported, the target stays where it is: no report is not no
    work.
    """

    def __init__(self, target_work_per_replica: float, work_per_request: float = 0.0):
        self.target = _number("target_work_per_replica", target_work_per_replica, positive=True)
        self.per_request = _number("work_per_request", work_per_request, positive=False)

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        """Serve's policy call, once per controller tick: (the replicas wanted, this policy's state)."""
        work, reporting = held_work(ctx)
        requests = ctx.total_num_requests if self.per_request else 0.0
        load = work + self.per_request * requests
        if ctx.current_num_replicas == 0 or reporting == 0:
            wanted = ctx.target_num_replicas  # nothing to go on: hold (Serve starts a replica on a request)
        else:
            wanted = math.ceil(load / self.target)
        replicas = min(max(wanted, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)
        level = logging.INFO if ctx.policy_state.get(_LAST) != replicas else logging.DEBUG
        if log.isEnabledFor(level):
            per_request = f", {requests:.1f} requests x {self.per_request:.0f}" if self.per_request else ""
            inputs = f"work {work:.0f} reported by {reporting} of {ctx.current_num_replicas} running replicas"
            _log_decision(ctx, level, f"{inputs}{per_request}, target {self.target:.0f} per replica -> {replicas}")
        return replicas, {_LAST: replicas}


def _number(name: str, value, positive: bool) -> float:
    """A policy kwarg, checked when the policy is built (by the config check too: genrec.serving.args)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {'positive' if positive else 'at least 0'}, got {value!r}")
    return float(value)


def held_work(ctx: AutoscalingContext) -> tuple[float, int]:
    """The work the running replicas hold, summed, and how many of them reported it."""
    per_replica = (ctx.aggregated_metrics or {}).get(WORK_METRIC) or {}
    running = set(ctx.running_replicas)
    values = [value for replica, value in per_replica.items() if replica in running]
    return float(sum(values)), len(values)


def _log_decision(ctx, level: int, decision: str) -> None:
    """One line with every input of the decision (a change at INFO; the same decision again, every tick, DEBUG)."""
    log.log(
        level,
        "genrec autoscaling %s/%s: %s replicas (bounds %d-%d, target now %d; Serve applies the up/down delays)",
        ctx.app_name,
        ctx.deployment_name,
        decision,
        ctx.capacity_adjusted_min_replicas,
        ctx.capacity_adjusted_max_replicas,
        ctx.target_num_replicas,
    )
