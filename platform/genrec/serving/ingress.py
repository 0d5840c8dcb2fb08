"""The HTTP ingress (FastAPI under `@serve.ingress`): auth, validation, user_id -> embedding, engine calls.

It does no model work. Its edge (edge.py) checks the token and bounds the body's size and arrival time before a
route reads it, and counts every answer. It checks the request (and that the engines' model family answers its
route), resolves the user's embedding through the shared cache (Qwen3 only; awaiting the actor, never blocking
the event loop), calls the engine deployment by handle under the request's deadline, with the request's routing
key (the user, see routing_key.py) for the engine deployment's request router, and turns every failure into the
status the client can act on (see http_errors).

With a ranker (args `ranker`: a second engine deployment, RankerServer, serving an HSTU model), /v1/rank goes
to the ranker, and a /v1/recommend whose body has `history` runs two stages under the request's one deadline:
the retriever's beam search, then the ranker's rank of the retrieved items (funnel.py), both calls with the
user's routing key, so that each user stays on one replica of each deployment.
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
from genrec.serving import edge, funnel
from genrec.serving.args import IngressLimits, IngressSettings, live_limits
from genrec.serving.http_errors import EngineUnavailable, NotServed, UnknownUser, error_response
from genrec.serving.metrics import IngressMetrics
from genrec.serving.router import ROUTING_KEY
from genrec.serving.routing_key import routing_key
from genrec.serving.schemas import ErrorBody, ModelInfo, RankBody, RecommendBody, RetrieveBody, ScoreBody

# Past the engine's own deadline, how long the ingress still waits for its answer before it gives up.
DEADLINE_GRACE_S = 2.0
MODEL_VERSION_HEADER = "X-Model-Version"
RANKER_VERSION_HEADER = "X-Ranker-Version"  # a two-stage recommend: the ranking model's version
# What the messages call each engine deployment: (its queues' owner, its replica).
NAMES = {"engine": ("the engines'", "the engine replica"), "ranker": ("the ranker's", "the ranker replica")}
MODEL_INFO_TTL_S = 30.0  # how long the ingress trusts what it learnt of the engines' model (its family)

api = FastAPI(
    title="genrec",
    description="Generative recommendation: retrieve, score, recommend (a semantic-ID decoder, Qwen3) or rank "
    "(HSTU); one model family per engine deployment (GET /v1/model says which). An app with a ranker also ranks: "
    "/v1/rank goes to it, and /v1/recommend with a `history` ranks the retrieved items with it (two stages).",
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
    def __init__(self, engine, settings: IngressSettings, limits: IngressLimits = IngressLimits(), ranker=None):
        self.engine, self.ranker = engine, ranker
        self.handles = {"engine": engine, "ranker": ranker}
        self.retry_after_s = settings.retry_after_s
        self.metrics = IngressMetrics()
        edge.configure(
            token=_read_token(settings.auth_token_env),
            body_timeout_s=settings.body_timeout_s,
            routes=frozenset(api.openapi()["paths"]),
            answered=self.metrics.answered,
        )
        self.routing_blocks = settings.routing_prefix_blocks
        self.cache_args = settings.cache
        self.cache = _connect_cache(settings.cache)
        self.limits = limits  # the builder's, until reconfigure (Serve calls it before the first request)
        # Each deployment's model ("engine", "ranker"), learnt on first use (see _check_served).
        self.info: dict[str, ModelInfo] = {}
        self.info_at: dict[str, float] = {}

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
        if body.history is not None:
            return await self._two_stage(body, response)
        return await self._serve("recommend", body, response)  # without history: the retriever's alone

    @api.post("/v1/rank", response_model=RankResult)
    async def rank(self, body: RankBody, response: Response, auth=Depends(bearer)):
        return await self._serve("rank", body, response)

    @api.get("/v1/model", response_model=ModelInfo)
    async def model(self, auth=Depends(bearer)):
        """The main engine's model; with a ranker, the ranker's under `ranker`."""
        try:
            info, ranker = await self._models(time.monotonic() + self.request_timeout_s)
            return info if ranker is None else info.model_copy(update={"ranker": ranker})
        except Exception as err:  # noqa: BLE001 - every failure becomes its status (see http_errors)
            return error_response(err, self.retry_after_s)

    @api.get("/healthz")
    @api.head("/healthz")  # load balancers probe with HEAD too
    async def healthz(self):
        """Ready when an engine replica answers, and a ranker replica in an app with a ranker (no auth: load
        balancers probe it)."""
        try:
            info, ranker = await self._models(time.monotonic() + 5.0)
            versions = {"model_version": info.version} | ({"ranker_version": ranker.version} if ranker else {})
            return {"status": "ok", **versions}
        except Exception as err:  # noqa: BLE001
            return error_response(err, self.retry_after_s)

    async def _models(self, deadline: float) -> tuple[ModelInfo, ModelInfo | None]:
        """The main engine's model and, in an app with a ranker, the ranker's, each asked of a replica."""
        info = await self._engine_call(self.engine.model_info.remote(), deadline)
        if self.ranker is None:
            return info, None
        return info, await self._engine_call(self.ranker.model_info.remote(), deadline, "ranker")

    async def _serve(self, kind: str, body, response: Response):
        """One deadline for the whole request: the embedding lookup, then the engine with the time left."""
        try:
            deadline = time.monotonic() + self.request_timeout_s
            target = "ranker" if kind == "rank" and self.ranker is not None else "engine"
            await self._check_served(target, kind, deadline)
            request = body.to_request(await self._user_embedding(body, deadline))
            key = routing_key(body, blocks=self.routing_blocks)
            result, version = await self._call(target, kind, request, deadline, key)
            response.headers[MODEL_VERSION_HEADER] = version
            return result
        except Exception as err:  # noqa: BLE001
            return error_response(err, self.retry_after_s)

    async def _two_stage(self, body: RecommendBody, response: Response):
        """The retriever's beam search, then the ranker's rank of what it found, under one deadline (funnel.py)."""
        try:
            deadline = time.monotonic() + self.request_timeout_s
            if self.ranker is None:
                raise InvalidRequestError("history", "this deployment has no ranker to rank by a history: leave it out")
            await self._check_served("engine", "retrieve", deadline)
            ranker = await self._check_served("ranker", "rank", deadline)
            task = funnel.check_body(body, ranker)
            request = body.to_request(await self._user_embedding(body, deadline))
            first = funnel.stage1(request)
            key = routing_key(body, first, self.routing_blocks)
            retrieved, version = await self._call("engine", "retrieve", first, deadline, key)
            items = funnel.candidates(request, retrieved)
            ranking, ranked, ranker_version = funnel.stage2(body, items), None, ranker.version
            if ranking is not None:
                key = routing_key(body, ranking, self.routing_blocks)
                ranked, ranker_version = await self._call("ranker", "rank_known", ranking, deadline, key)
            response.headers[MODEL_VERSION_HEADER] = version
            response.headers[RANKER_VERSION_HEADER] = ranker_version
            return funnel.merge(items, retrieved, ranked, task, body.num_results, ranker_version)
        except Exception as err:  # noqa: BLE001
            return error_response(err, self.retry_after_s)

    async def _call(self, target: str, method: str, request, deadline: float, key: str):
        """(result, model version) of one engine deployment's method, with the time left of the deadline."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RequestTimeout(f"no answer within {self.request_timeout_s:g} s ({target} not reached)")
        call = getattr(self.handles[target], method).remote(request, remaining, **{ROUTING_KEY: key})
        try:
            return await self._engine_call(call, deadline, target)
        except NotServed:
            self.info.pop(target, None)  # the deployment's model is not the one learnt (a new model): ask again
            raise

    async def _check_served(self, target: str, kind: str, deadline: float) -> ModelInfo:
        """A route of the other model family is refused here, before any embedding lookup (404 not_served)."""
        info = self.info.get(target)
        if info is None or time.monotonic() - self.info_at[target] > MODEL_INFO_TTL_S:
            info = await self._engine_call(self.handles[target].model_info.remote(), deadline, target)
            self.info[target], self.info_at[target] = info, time.monotonic()
        if kind not in info.serves:
            raise NotServed(kind, info.family, info.serves)
        return info

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

    async def _engine_call(self, response, deadline: float, target: str = "engine"):
        """The engine's answer; past the deadline (+ grace for the engine's own 504), give up and cancel."""
        queues, replica = NAMES[target]
        try:
            return await asyncio.wait_for(response, max(0.0, deadline - time.monotonic()) + DEADLINE_GRACE_S)
        except RayTaskError as err:  # first: a RayTaskError wrapping the engine's RequestTimeout is a TimeoutError
            raise _cause(err) from None
        except TimeoutError:
            response.cancel()  # the engine drops the request at its next step
            raise RequestTimeout(f"no answer within {self.request_timeout_s:g} s") from None
        except BackPressureError as err:
            raise Overloaded(f"{queues} queues are full ({err})", self.retry_after_s) from None
        except (RayActorError, DeploymentUnavailableError, ReplicaUnavailableError) as err:
            raise EngineUnavailable(f"{replica} is unavailable ({type(err).__name__}); retry") from None
