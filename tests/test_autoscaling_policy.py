"""genrec's autoscaling policy (genrec.serving.autoscaling): scaling on the work the engine replicas hold, not on
their request count. First the policy alone on built AutoscalingContexts, wrapped as Serve's controller wraps every
policy (delays, bounds); then once on the session's Ray, a stand-in deployment reporting work through
`record_autoscaling_stats`."""

import logging
import math
import subprocess
import sys
import time

import pytest
from ray import serve
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy
from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy

from genrec.serving.autoscaling import WORK_METRIC, WORK_POLICY, WorkPolicy

# The work of a request (Scheduler.work_of) on Qwen3-1.7B with 5 code levels (tests/test_work_in_flight.py checks
# these): beam 1,024 over 5,000 tokens; beam 30 over 2,000 (the configs' typical request); beam 8 over 100.
WIDE, TYPICAL, NARROW = 21_441, 2_674, 181
TARGET = 64_000  # the GPU configs' target: about 24 typical requests per replica
DEPLOYMENT = DeploymentID(name="EngineServer", app_name="genrec")


def replicas(n: int) -> list[ReplicaID]:
    return [ReplicaID(unique_id=f"r{i}", deployment_id=DEPLOYMENT) for i in range(n)]


def context(work: list[float], requests: float = 0.0, **given) -> AutoscalingContext:
    """A deployment of len(work) running replicas, each reporting its work; `given` overrides any field."""
    running = replicas(len(work))
    config = given.pop("config", None) or AutoscalingConfig(
        min_replicas=2, max_replicas=8, target_ongoing_requests=24, upscale_delay_s=0, downscale_delay_s=0
    )
    fields = dict(
        deployment_id=DEPLOYMENT,
        deployment_name=DEPLOYMENT.name,
        app_name=DEPLOYMENT.app_name,
        current_num_replicas=len(running),
        target_num_replicas=len(running),
        running_replicas=running,
        total_num_requests=requests,
        total_queued_requests=0.0,
        aggregated_metrics={WORK_METRIC: dict(zip(running, work, strict=True))},
        raw_metrics={},
        capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=time.time(),
        config=config,
    )
    return AutoscalingContext(**(fields | given))


def decide(ctx: AutoscalingContext, **kwargs) -> int:
    replicas_wanted, state = WorkPolicy(**({"target_work_per_replica": TARGET} | kwargs))(ctx)
    assert set(state) == {"genrec_replicas"}  # its own key only: Serve keeps its delay state beside it
    return replicas_wanted


def request_count_decision(ctx: AutoscalingContext) -> int:
    """What Serve's default policy (target_ongoing_requests) would ask for, within the same bounds."""
    wanted, _ = replica_queue_length_autoscaling_policy(ctx)
    return min(max(math.ceil(wanted), ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)


def test_a_few_very_wide_requests_scale_out_where_the_request_count_would_not():
    ctx = context([5 * WIDE, 3 * WIDE], requests=8)  # 8 requests on 2 replicas: a third of target_ongoing_requests
    assert request_count_decision(ctx) == 2
    assert decide(ctx) == math.ceil(8 * WIDE / TARGET) == 3


def test_many_narrow_requests_do_not_over_scale():
    ctx = context([100 * NARROW, 100 * NARROW], requests=200)  # 200 requests: 8 replicas by the request count
    assert request_count_decision(ctx) == 8
    assert decide(ctx) == 2
    assert decide(context([12 * TYPICAL] * 2, requests=24)) == 2  # a target's worth of typical ones fills one


def test_the_decision_stays_within_the_capacity_adjusted_bounds():
    assert decide(context([100 * TARGET, 0])) == 8
    assert decide(context([0.0, 0.0])) == 2
    # KubeRay's incremental upgrade at target_capacity 50: Serve hands the policy min 1, max 4
    assert decide(context([100 * TARGET, 0], capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4)) == 4
    assert decide(context([0.0, 0.0], capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4)) == 1


def test_it_holds_until_a_running_replica_has_reported():
    assert decide(context([], target_num_replicas=3)) == 3  # no report yet: not no work
    stale = {WORK_METRIC: {ReplicaID(unique_id="gone", deployment_id=DEPLOYMENT): 100 * TARGET}}
    assert decide(context([0.0, 0.0], aggregated_metrics=stale)) == 2  # a stopped replica's report is not counted
    assert decide(context([0.0, 0.0], aggregated_metrics={})) == 2


def test_a_fixed_cost_per_request_counts_when_the_config_names_one():
    ctx = context([100 * NARROW, 100 * NARROW], requests=200)
    assert decide(ctx) == 2
    assert decide(ctx, work_per_request=1_500) == math.ceil((200 * NARROW + 200 * 1_500) / TARGET) == 6


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"target_work_per_replica": 0}, {"target_work_per_replica": "64k"}, {"target_work_per_replica": True}]
    + [{"target_work_per_replica": 1, "work_per_request": -1}, {"target_work": 1}],
)
def test_bad_kwargs_are_refused_when_the_policy_is_built(kwargs):
    with pytest.raises((TypeError, ValueError)):
        WorkPolicy(**kwargs)


def controller_policy(**kwargs):
    """The policy as Serve's controller calls it: built from the config's import path and kwargs, in Serve's
    wrapper (autoscaling_state.DeploymentAutoscalingState.register), which applies the delays and scaling factors."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    policy = AutoscalingPolicy(policy_function=WORK_POLICY, policy_kwargs={"target_work_per_replica": TARGET} | kwargs)
    return _apply_autoscaling_config(_resolve_policy_callable(policy))


class Clock:
    def __init__(self):
        self.now = 1_000.0

    def time(self) -> float:
        return self.now


def test_the_upscale_and_downscale_delays_hold_as_for_serves_own_policy(monkeypatch):
    import ray.serve.autoscaling_policy as serve_policy

    clock = Clock()
    monkeypatch.setattr(serve_policy, "time", clock)  # the wrapper's delays read time.time()
    policy = controller_policy()
    config = AutoscalingConfig(min_replicas=2, max_replicas=8, upscale_delay_s=30, downscale_delay_s=600)
    state = {}

    def tick(work: list[float], at: float) -> int:
        """The controller's decision at `at` s, with len(work) replicas running and its target where they are."""
        nonlocal state
        clock.now = 1_000.0 + at
        wanted, state = policy(context(work, config=config, policy_state=state))
        assert "genrec_replicas" in state  # its own state kept beside Serve's
        return wanted

    wants_four = [2 * TARGET, 2 * TARGET]
    assert tick(wants_four, 0) == 2 and tick(wants_four, 29) == 2  # wanted, not for upscale_delay_s yet
    assert tick([0.0, 0.0], 29.5) == 2  # nothing wanted: the count starts again
    assert tick(wants_four, 30) == 2 and tick(wants_four, 59) == 2
    assert tick(wants_four, 60) == 4
    idle = [0.0] * 4
    assert tick(idle, 61) == 4 and tick(idle, 61 + 599) == 4  # down to min_replicas, after downscale_delay_s
    assert tick(idle, 61 + 600) == 2


def test_each_changed_decision_is_logged_with_its_inputs(caplog):
    policy = WorkPolicy(target_work_per_replica=TARGET)
    with caplog.at_level(logging.DEBUG, logger="ray.serve.genrec_autoscaling"):
        _, state = policy(context([2 * TARGET, 2 * TARGET]))
        policy(context([2 * TARGET, 2 * TARGET], policy_state=state))
    first, again = caplog.records
    assert first.levelno == logging.INFO and again.levelno == logging.DEBUG
    line = first.getMessage()
    assert "genrec/EngineServer" in line and "work 256000 reported by 2 of 2 running replicas" in line
    assert "target 64000 per replica -> 4 replicas (bounds 2-8" in line


def test_the_policy_module_loads_without_torch_or_the_engine():
    """It runs in Serve's controller, which has no business loading torch."""
    code = (
        "import sys, genrec.serving.autoscaling; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('genrec.engine.') "
        "or m == 'genrec.engine'); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- once on a local Ray cluster: a stand-in engine replica ----------------------------------------------------------


@serve.deployment(ray_actor_options={"num_cpus": 0})
class HeldWork:
    """Reports the work it is told to hold, as an engine replica reports its engine's (EngineServer)."""

    def __init__(self):
        self.work = 0.0

    def hold(self, work: float) -> None:
        self.work = work

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {WORK_METRIC: self.work}


def running_replicas(app: str) -> int:
    status = serve.status().applications[app].deployments["HeldWork"]
    return status.replica_states.get("RUNNING", 0)


@pytest.mark.timeout(300)
def test_replicas_go_up_when_the_reported_work_is_high(serve_url):
    """No request at all, so Serve's request count asks for nothing; the work one replica reports asks for three."""
    scaling = {
        "min_replicas": 1,
        "max_replicas": 3,
        "upscale_delay_s": 0.5,
        "downscale_delay_s": 600,
        "metrics_interval_s": 0.2,  # how often a replica pushes (and, here, records) its stats
        "look_back_period_s": 1.0,
        "policy": {"policy_function": WORK_POLICY, "policy_kwargs": {"target_work_per_replica": 100}},
    }
    handle = serve.run(HeldWork.options(autoscaling_config=scaling).bind(), name="held-work", route_prefix=None)
    try:
        time.sleep(2)  # a few decisions on zero work
        assert running_replicas("held-work") == 1
        handle.hold.remote(250.0).result(timeout_s=30)  # one replica, so this one: 3 replicas' worth
        deadline = time.monotonic() + 150  # replicas that start slowly on a loaded machine
        while running_replicas("held-work") < 3:
            assert time.monotonic() < deadline, f"still {running_replicas('held-work')} replicas"
            time.sleep(0.25)
    finally:
        serve.delete("held-work", _blocking=False)
