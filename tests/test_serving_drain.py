"""A replaced ingress finishes its requests: Serve waits longer than a request's deadline before it kills a
replaced ingress replica (its graceful shutdown), so a request in flight ends with genrec's JSON answer by its
deadline, never the HTTP proxy's plain-text 500. Settings first, without Ray; then a real Serve app under load,
redeployed so that its ingress and its ranker are replaced and the new ranker never starts."""

import pytest
from pydantic import ValidationError

from genrec.serving.args import DRAIN_MARGIN_S, AppArgs, IngressLimits


def ingress(**fields):
    return AppArgs(retriever={"model_dir": "/m"}, ingress=fields).ingress


def test_serve_waits_for_a_replaced_ingress_longer_than_a_deadline():
    section = ingress(limits={"request_timeout_s": 25})
    options = section.deployment_options(section.defaults())
    assert options["graceful_shutdown_timeout_s"] == 25 + DRAIN_MARGIN_S == section.drain_s()
    assert ingress().drain_s() == 30 + DRAIN_MARGIN_S  # Serve's own default, 20 s, is below the default deadline
    longer = ingress(limits={"request_timeout_s": 25}, deployment={"graceful_shutdown_timeout_s": 90})
    assert longer.deployment_options(longer.defaults())["graceful_shutdown_timeout_s"] == 90


def test_a_drain_shorter_than_the_deadline_is_refused_naming_the_field():
    with pytest.raises(ValidationError, match="graceful_shutdown_timeout_s") as error:
        ingress(limits={"request_timeout_s": 25}, deployment={"graceful_shutdown_timeout_s": 20})
    assert "at least 30" in str(error.value)


def test_a_live_deadline_the_drain_cannot_cover_is_refused_and_the_running_one_stays():
    section = ingress(limits={"request_timeout_s": 25})
    running = IngressLimits(request_timeout_s=25)
    assert section.live({"request_timeout_s": 10}, running) == (IngressLimits(request_timeout_s=10), None)
    assert section.live({"request_timeout_s": 25}, running)[1] is None  # just covered
    kept, refused = section.live({"request_timeout_s": 25.5}, running)
    assert kept is running and f"graceful_shutdown_timeout_s of at least {25.5 + DRAIN_MARGIN_S:g}" in refused
    kept, refused = section.live({"request_timeout_s": -1}, running)  # what live_limits refuses, as before
    assert kept is running and "request_timeout_s" in refused
