"""A two-stage recommend through the ingress's own code (`Ingress._two_stage`) without Ray: its deployment handles
are in-process engines, and every remote call it makes is recorded (deployment, method, request, result)."""

import asyncio
import json
from dataclasses import dataclass, field
from types import SimpleNamespace

from fastapi import Response

from genrec.api import RecommendResult
from genrec.serving import ingress as ingress_module
from genrec.serving.args import IngressSection
from genrec.serving.schemas import RankerFacts, RecommendBody


@dataclass
class Call:
    deployment: str
    method: str
    request: object
    result: object = None


@dataclass
class EngineHandle:
    """A deployment handle's stand-in: `handle.<method>.remote(request, timeout_s, **routing)` answers as the
    EngineServer's method does, (the engine's result, a version), and records the call."""

    name: str
    engine: object
    calls: list[Call] = field(default_factory=list)
    app_name: str = "app"

    @property
    def deployment_name(self) -> str:
        return self.name

    def __getattr__(self, method: str):
        return SimpleNamespace(remote=lambda request=None, timeout_s=None, **_: self._answer(method, request))

    async def _answer(self, method: str, request):
        call = Call(self.name, method, request)
        self.calls.append(call)
        if method == "model_info":
            return SimpleNamespace(version=f"{self.name}-version")
        (call.result,) = getattr(self.engine, method)([request])  # raises the request's error, as the server does
        return call.result, f"{self.name}-version"


class _QuietMetrics:
    def __init__(self, **_):
        pass

    def degraded(self, reason: str) -> None:
        pass


def two_stage(retriever, ranker, body: dict, monkeypatch) -> tuple[int, dict, list[Call]]:
    """(status, answer, the remote calls in order) of a /v1/recommend with `body` (it has a history) by an app of
    these two engines."""
    monkeypatch.setattr(ingress_module, "IngressMetrics", _QuietMetrics)  # Ray's metrics need a cluster
    calls: list[Call] = []
    facts = RankerFacts.of(ranker.model.config, ranker.family.max_candidates)
    handles = EngineHandle("retriever", retriever, calls), EngineHandle("ranker", ranker, calls)
    # The class as written, not Serve's ASGI wrapper of it (whose constructor and finalizer are coroutines).
    cls = next(k for k in ingress_module.Ingress.func_or_class.__mro__ if "_two_stage" in vars(k))
    ingress = cls(*handles, IngressSection(), facts)
    answer = asyncio.run(ingress._two_stage(RecommendBody.model_validate(body), Response()))
    if isinstance(answer, RecommendResult):
        return 200, answer.model_dump(), calls
    return answer.status_code, json.loads(answer.body), calls
