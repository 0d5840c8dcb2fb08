"""The HTTP ingress (FastAPI under `@serve.ingress`): auth, validation, user_id -> embedding, engine calls.

It does no model work. Its edge (edge.py) checks the token and bounds the body's size and arrival time before a
route reads it, and counts every answer. It checks the request (and that the engines' model family answers its
route), resolves the user's embedding through the shared cache (Qwen3 only; awaiting the actor, never blocking
the event loop), calls the engine deployment by handle under the request's deadline, with the request's routing
key (the user, see routing_key.py) for the engine deployment's request router, and turns every failure into the
status the client can act on (see http_errors).
"""

# No `from __future__ import annotations` here: FastAPI reads the route signatures' real types.
import asyncio
import os
import time

from fastapi import Depends, FastAPI, Response
from fastapi.security import HTTPBearer
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

from genrec.api import RankResult, RecommendResult, RetrieveResult, ScoreResult
from genrec.cache.actor import EmbeddingCache
from genrec.errors import CacheError, InvalidRequestError, Overloaded, RequestTimeout, StoreError
from genrec.serving import edge
from genrec.serving.args import IngressLimits, IngressSettings, live_limits
from genrec.serving.http_errors import EngineUnavailable, NotServed, UnknownUser, error_response
from genrec.serving.metrics import IngressMetrics
from genrec.serving.router import ROUTING_KEY
from genrec.serving.routing_key import routing_key
from genrec.serving.schemas import ErrorBody, ModelInfo, RankBody, RecommendBody, RetrieveBody, ScoreBody

# Past the engine's own deadline, how long the ingress still waits for its answer before it gives up.
DEADLINE_GRACE_S = 2.0
MODEL_VERSION_HEADER = "X-Model-Version"
MODEL_INFO_TTL_S = 30.0  # how long the ingress trusts what it learnt of the engines' model (its family)

api = FastAPI(
    title="genrec",
    description="Generative recommendation: retrieve, score, recommend (a semantic-ID decoder, Qwen3) or rank "
    "(HSTU); one model family per deployment (GET /v1/model says which).",
    responses={code: {"model": ErrorBody} for code in (400, 401, 404, 408, 413, 422, 503, 504)},
)
edge.install(api)  # error bodies; auth, body size and body timeout before a route reads the body; answers counted
# The routes declare the bearer scheme for the OpenAPI docs; the edge checks the token, before the body is read.
bearer = HTTPBearer(auto_error=False, description="set when the deployment has auth_token_env")


def _cause(err: RayTaskError) -> BaseException:
    """The exception the engine raised (its class and fields), not Ray's wrapper around it."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


def _read_token(env_name: str | None) -> bytes | None:
    if env_name is None:
        return None
    token = os.environ.get(env_name, "")
    if not token:
        raise ValueError(f"auth_token_env is {env_name!r} but that environment variable is unset or empty")
    return token.encode()


def _connect_cache(cache_args):
    return EmbeddingCache.connect(cache_args) if cache_args is not None else None


# The class is serialised when it is decorated: everything it calls must already be defined above.
@serve.deployment(name="Ingress", max_ongoing_requests=1024)
@serve.ingress(api)
class Ingress:
    def __init__(self, engine, settings: IngressSettings, limits: IngressLimits = IngressLimits()):
        self.engine = engine
        self.retry_after_s = settings.retry_after_s
        self.metrics = IngressMetrics()
        edge.configure(
            token=_read_token(settings.auth_token_env),
            body_timeout_s=settings.body_timeout_s,
            routes=frozenset(api.openapi()["paths"]),
            answered=self.metrics.answered,
        )
        self.cache_args = settings.cache
        self.cache = _connect_cache(settings.cache)
        self.limits = limits  # the builder's, until reconfigure (Serve calls it before the first request)
        self.info: ModelInfo | None = None  # the engines' model, learnt on first use (see _check_served)
        self.info_at = 0.0

    @property
    def request_timeout_s(self) -> float:
        return self.limits.request_timeout_s

    def reconfigure(self, user_config: dict) -> None:
        """The request deadline changes live (`user_config`), without replacing the replica; a config that
        does not validate is refused and the running deadline stays (args.live_limits)."""
        self.limits, refused = live_limits(IngressLimits, user_config, self.limits)
        self.metrics.refused = refused is not None

    @api.post("/v1/retrieve", response_model=RetrieveResult)
    async def retrieve(self, body: RetrieveBody, response: Response, auth=Depends(bearer)):
        return await self._serve("retrieve", body, response)

    @api.post("/v1/score", response_model=ScoreResult)
    async def score(self, body: ScoreBody, response: Response, auth=Depends(bearer)):
        return await self._serve("score", body, response)

    @api.post("/v1/recommend", response_model=RecommendResult)
    async def recommend(self, body: RecommendBody, response: Response, auth=Depends(bearer)):
        return await self._serve("recommend", body, response)

    @api.post("/v1/rank", response_model=RankResult)
    async def rank(self, body: RankBody, response: Response, auth=Depends(bearer)):
        return await self._serve("rank", body, response)

    @api.get("/v1/model", response_model=ModelInfo)
    async def model(self, auth=Depends(bearer)):
        try:
            deadline = time.monotonic() + self.request_timeout_s
            return await self._engine_call(self.engine.model_info.remote(), deadline)
        except Exception as err:  # noqa: BLE001 - every failure becomes its status (see http_errors)
            return error_response(err, self.retry_after_s)

    @api.get("/healthz")
    @api.head("/healthz")  # load balancers probe with HEAD too
    async def healthz(self):
        """Ready when an engine replica answers (no auth: load balancers probe it)."""
        try:
            info = await self._engine_call(self.engine.model_info.remote(), time.monotonic() + 5.0)
            return {"status": "ok", "model_version": info.version}
        except Exception as err:  # noqa: BLE001
            return error_response(err, self.retry_after_s)

    async def _serve(self, kind: str, body, response: Response):
        """One deadline for the whole request: the embedding lookup, then the engine with the time left."""
        try:
            deadline = time.monotonic() + self.request_timeout_s
            await self._check_served(kind, deadline)
            request = body.to_request(await self._user_embedding(body, deadline))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeout(f"no answer within {self.request_timeout_s:g} s (the embedding lookup)")
            call = getattr(self.engine, kind).remote(request, remaining, **{ROUTING_KEY: routing_key(body)})
            try:
                result, version = await self._engine_call(call, deadline)
            except NotServed:
                self.info = None  # the engines' model is not the one learnt (a new model): ask again next time
                raise
            response.headers[MODEL_VERSION_HEADER] = version
            return result
        except Exception as err:  # noqa: BLE001
            return error_response(err, self.retry_after_s)

    async def _check_served(self, kind: str, deadline: float) -> None:
        """A route of the other model family is refused here, before any embedding lookup (404 not_served)."""
        if self.info is None or time.monotonic() - self.info_at > MODEL_INFO_TTL_S:
            self.info = await self._engine_call(self.engine.model_info.remote(), deadline)
            self.info_at = time.monotonic()
        if kind not in self.info.serves:
            raise NotServed(kind, self.info.family, self.info.serves)

    async def _user_embedding(self, body, deadline: float) -> list[float] | None:
        if getattr(body, "user_embedding", None) is not None or body.user_id is None or isinstance(body, RankBody):
            return None  # an inline vector wins; no user_id, nothing to look up; a ranker takes no vector
        if self.cache_args is None:
            raise InvalidRequestError("user_id", "this deployment has no embedding cache; send user_embedding")
        try:
            if self.cache is None:  # the last lookup found the cache gone: connect again (off the loop)
                self.cache = await asyncio.to_thread(_connect_cache, self.cache_args)
            lookup = self.cache.get_async([body.user_id])
            vectors, found = await asyncio.wait_for(lookup, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise RequestTimeout(f"the embedding lookup took longer than {self.request_timeout_s:g} s") from None
        except CacheError as err:
            raise InvalidRequestError("user_id", str(err)) from None
        except (RayActorError, StoreError) as err:
            self.cache = None
            raise EngineUnavailable(f"the embedding cache is unavailable ({type(err).__name__}); retry") from None
        if not found[0]:
            raise UnknownUser(body.user_id)
        return vectors[0].tolist()

    async def _engine_call(self, response, deadline: float):
        """The engine's answer; past the deadline (+ grace for the engine's own 504), give up and cancel."""
        try:
            return await asyncio.wait_for(response, max(0.0, deadline - time.monotonic()) + DEADLINE_GRACE_S)
        except RayTaskError as err:  # first: a RayTaskError wrapping the engine's RequestTimeout is a TimeoutError
            raise _cause(err) from None
        except TimeoutError:
            response.cancel()  # the engine drops the request at its next step
            raise RequestTimeout(f"no answer within {self.request_timeout_s:g} s") from None
        except BackPressureError as err:
            raise Overloaded(f"the engines' queues are full ({err})", self.retry_after_s) from None
        except (RayActorError, DeploymentUnavailableError, ReplicaUnavailableError) as err:
            raise EngineUnavailable(f"the engine replica is unavailable ({type(err).__name__}); retry") from None
