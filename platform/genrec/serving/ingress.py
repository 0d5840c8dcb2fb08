"""The HTTP ingress (FastAPI under `@serve.ingress`, one app per replica behind edge.py): auth, validation,
user_id -> embedding (the shared cache, awaited off the event loop), the routing key (router.py) and engine calls
under the request's one deadline; no model work. Every failure becomes a status a client can act on
(http_errors.py); a /v1/recommend with `history` runs two stages (funnel.py). Docs: docs/serving.md, 'Routes',
'Two stages: the funnel online', 'When a deployment goes away'.
"""

# No `from __future__ import annotations` here: FastAPI reads the route signatures' real types.
import asyncio
import logging
import os
import time

from fastapi import Depends, FastAPI, Response
from fastapi.security import HTTPBearer
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

from genrec.api import (
    FAMILY_KINDS,
    PromptRequest,
    PromptResult,
    RankResult,
    RecommendResult,
    RetrieveResult,
    ScoreResult,
)
from genrec.cache.actor import EmbeddingCache
from genrec.errors import CacheError, InvalidRequestError, Overloaded, RequestTimeout, StoreError
from genrec.serving import edge, funnel
from genrec.serving.args import DEPLOYMENTS, FAMILY, IngressSection
from genrec.serving.http_errors import CatalogNotServed, EngineUnavailable, NotServed, UnknownUser, error_response
from genrec.serving.metrics import IngressMetrics
from genrec.serving.replicas import board, live_replicas
from genrec.serving.router import ROUTING_KEY, routing_key
from genrec.serving.schemas import (
    ErrorBody,
    ModelInfo,
    RankBody,
    RankerFacts,
    RecommendBody,
    RetrieveBody,
    ScoreBody,
    cache_scope,
)

log = logging.getLogger(__name__)

# Kept of every deadline to build and send the answer: the ingress stops waiting for an engine this much earlier.
ANSWER_MARGIN_S = 0.05
WATCH_S = 0.05  # how often a two-stage recommend's ranking looks whether the ranker still has a replica
MODEL_VERSION_HEADER = "X-Model-Version"
RANKER_VERSION_HEADER = "X-Ranker-Version"  # a two-stage recommend: the ranking model's version
# What the messages call each engine deployment: (its queues' owner, its replica).
NAMES = {"retriever": ("the engines'", "the engine replica"), "ranker": ("the ranker's", "the ranker replica")}
SECTION_OF = {kind: section for section, family in FAMILY.items() for kind in FAMILY_KINDS[family]}
SECTION_OF["prompt"] = "retriever"  # POST /v1/prompt: the rendered prompt of the model that reads prompts
ERROR_CODES = (400, 401, 404, 408, 413, 422, 503, 504)
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


def build_api(ingress) -> FastAPI:
    """The ingress replica's HTTP app: its routes bound to the replica, behind an edge with its own settings."""
    api = FastAPI(
        title="genrec",
        description="Generative recommendation: retrieve, score, recommend (a semantic-ID decoder, Qwen3) and rank "
        "(HSTU), each answered by the app's deployment of that family (GET /v1/model says which it has). With both, "
        "/v1/recommend with a `history` ranks the retrieved items with the ranker (two stages).",
        responses={code: {"model": ErrorBody} for code in ERROR_CODES},
    )
    for path, method, result in (
        ("/v1/retrieve", ingress.retrieve, RetrieveResult),
        ("/v1/score", ingress.score, ScoreResult),
        ("/v1/recommend", ingress.recommend, RecommendResult),
        ("/v1/rank", ingress.rank, RankResult),
        ("/v1/prompt", ingress.prompt, PromptResult),
    ):
        api.add_api_route(path, method, methods=["POST"], response_model=result)
    api.add_api_route("/v1/model", ingress.model, methods=["GET"], response_model=ModelInfo)
    api.add_api_route("/healthz", ingress.healthz, methods=["GET", "HEAD"])  # load balancers probe with HEAD too
    settings = edge.EdgeSettings(
        token=_read_token(ingress.settings.auth_token_env),
        body_timeout_s=ingress.settings.body_timeout_s,
        routes=frozenset(api.openapi()["paths"]),
        answered=ingress.metrics.answered,
    )
    edge.install(api, settings)
    return api


# The class is serialised when it is decorated: everything it calls must already be defined above.
@serve.deployment(name="Ingress", max_ongoing_requests=1024)
@serve.ingress()
class Ingress:
    def __init__(
        self,
        retriever,
        ranker,
        settings: IngressSection,
        ranker_facts: RankerFacts | None = None,
        idle_at_zero: frozenset[str] = frozenset(),
    ):
        """`retriever`, `ranker`: engine deployment handles (None: no such section); `ranker_facts`: what a two-stage
        request is checked against (None: asked of the ranker on first use); `idle_at_zero`: the deployments that
        scale to zero while idle (EngineSection.scales_to_zero)."""
        self.handles = {"retriever": retriever, "ranker": ranker}
        self.idle_at_zero = idle_at_zero
        self.settings = settings
        self.retry_after_s = settings.retry_after_s
        self.metrics = IngressMetrics(funnel=retriever is not None and ranker is not None)
        _read_token(settings.auth_token_env)  # an unset token fails the replica's start, not its first request
        self.routing_blocks = settings.routing_prefix_blocks
        self.cache_args = settings.cache
        self.cache = _connect_cache(settings.cache)
        self.limits = settings.limits  # the builder's, until reconfigure (Serve calls it before the first request)
        self.ranker_facts = ranker_facts

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self)

    @property
    def request_timeout_s(self) -> float:
        return self.limits.request_timeout_s

    def reconfigure(self, user_config: dict) -> None:
        """The deadline, live; refused, the running one staying: a config that does not validate (args.live_limits)
        or a deadline longer than a replaced replica is given to finish (IngressSection.drain_problem)."""
        self.limits, refused = self.settings.live(user_config, self.limits)
        self.metrics.refused = refused is not None

    async def retrieve(self, body: RetrieveBody, response: Response, auth=Depends(bearer)):
        return await self._serve("retrieve", body, response)

    async def score(self, body: ScoreBody, response: Response, auth=Depends(bearer)):
        return await self._serve("score", body, response)

    async def recommend(self, body: RecommendBody, response: Response, auth=Depends(bearer)):
        if body.history is not None:
            return await self._two_stage(body, response)
        return await self._serve("recommend", body, response)  # without history: the retriever's alone

    async def rank(self, body: RankBody, response: Response, auth=Depends(bearer)):
        return await self._serve("rank", body, response)

    async def prompt(self, body: PromptRequest, response: Response, auth=Depends(bearer)):
        """The prompt as the retriever's engine runs it, checked as a request's prompt is."""
        try:
            deadline = edge.arrived() + self.request_timeout_s
            target = self._deployment_of("prompt")
            result, version = await self._call(
                target, "render_prompt", body, deadline, routing_key(body, blocks=self.routing_blocks)
            )
            response.headers[MODEL_VERSION_HEADER] = version
            return result
        except Exception as err:  # noqa: BLE001
            return error_response(err, self.retry_after_s)

    async def model(self, auth=Depends(bearer)):
        """The retriever's model (the ranker's under `ranker`), else the ranker's; each with its `replicas` and
        their catalog versions (the board)."""
        try:
            infos = await self._models(time.monotonic() + self.request_timeout_s)
            for name, info in infos.items():
                infos[name] = info.model_copy(update={"replicas": await self._replicas(name)})
            if len(infos) == 2:
                return infos["retriever"].model_copy(update={"ranker": infos["ranker"]})
            return next(iter(infos.values()))
        except Exception as err:  # noqa: BLE001 - every failure becomes its status (see http_errors)
            return error_response(err, self.retry_after_s)

    async def healthz(self):
        """Ready when each engine deployment answers and, with a retriever, one replica serves its declared catalog
        (else 503 catalog_not_served); no auth. `catalog`: the retriever's replicas by schemas.CatalogStatus."""
        try:
            infos = await self._models(time.monotonic() + 5.0)
            versions = {"model_version": infos.get("retriever", infos.get("ranker")).version}
            if len(infos) == 2:
                versions["ranker_version"] = infos["ranker"].version
            catalog = await self._catalog_health() if "retriever" in infos else {}
            return {"status": "ok", **versions, **catalog}
        except Exception as err:  # noqa: BLE001
            return error_response(err, self.retry_after_s)

    async def _catalog_health(self) -> dict:
        """{"catalog": retriever replicas by catalog status}, {} if none on the board; CatalogNotServed: all refuse."""
        replicas = await self._replicas("retriever") or []
        counts = dict.fromkeys(("declared", "kept_running", "refusing"), 0)
        for replica in replicas:
            if replica.get("catalog_status") in counts:
                counts[replica["catalog_status"]] += 1
        if replicas and counts["refusing"] == len(replicas):  # no path named: /healthz needs no token
            raise CatalogNotServed(None, "no retriever replica can load it: GET /v1/model says why")
        return {"catalog": counts} if replicas else {}

    async def _models(self, deadline: float) -> dict[str, ModelInfo]:
        """The model of each of the app's engine deployments, each asked of a replica."""
        return {
            name: await self._engine_call(handle.model_info.remote(), deadline, name)
            for name, handle in self.handles.items()
            if handle is not None
        }

    async def _replicas(self, name: str) -> list[dict] | None:
        """The section's replicas as last reported (replicas.py), less those our router knows gone; None: no board."""
        try:
            app = serve.get_replica_context().app_name
            reader = await asyncio.to_thread(board, app)
            reported = await asyncio.wait_for(reader.replicas.remote(DEPLOYMENTS[name]), 2.0)
            live = live_replicas(app, DEPLOYMENTS[name])
            return reported if live is None else [r for r in reported if r["replica"] in live]
        except Exception as err:  # noqa: BLE001 - a view: /v1/model answers without it
            log.warning("genrec: the replica board could not be read (%s)", err)
            return None

    async def _serve(self, kind: str, body, response: Response):
        """One deadline for the whole request: the embedding lookup, then the engine with the time left."""
        try:
            deadline = edge.arrived() + self.request_timeout_s  # the body's reading and validation included
            target = self._deployment_of(kind)
            request = body.to_request(await self._user_embedding(body, deadline))
            key = routing_key(body, blocks=self.routing_blocks)
            result, version = await self._call(target, kind, request, deadline, key)
            response.headers[MODEL_VERSION_HEADER] = version
            return result
        except Exception as err:  # noqa: BLE001
            return error_response(err, self.retry_after_s)

    async def _two_stage(self, body: RecommendBody, response: Response):
        """The retriever's recommend in beam order, then the ranker's rank of its items, under one deadline
        (funnel.py; docs/serving.md, 'When the ranker fails')."""
        try:
            started = edge.arrived()  # the body's reading and validation included
            deadline = started + self.request_timeout_s
            first_deadline = started + funnel.stage1_timeout(self.request_timeout_s, self.settings.funnel_reserve_s)
            self._deployment_of("recommend")
            if self.handles["ranker"] is None:
                raise InvalidRequestError("history", "this deployment has no ranker to rank by a history: leave it out")
            # Refused before stage 1 runs; without the builder's facts of the ranker, checked by stage 2 (a ranker
            # that does not answer must not hold stage 1 up).
            if self.ranker_facts is not None:
                funnel.check_body(body, self.ranker_facts)
            else:
                funnel.check_form(body)
            first = funnel.stage1(body.to_request(await self._user_embedding(body, first_deadline)))
            key = routing_key(body, first, self.routing_blocks)
            # The retriever is given stage 1's time; a late answer is still taken until the deadline.
            stage1, version = await self._call("retriever", "recommend", first, deadline, key, first_deadline)
            response.headers[MODEL_VERSION_HEADER] = version
            try:
                task, ranked, ranker_version = await self._stage2(body, stage1.items, deadline)
            except Exception as err:  # noqa: BLE001 - funnel.degraded_reason tells the client's mistakes apart
                reason = funnel.degraded_reason(err)
                if reason is None or self.settings.funnel_on_ranker_failure == "fail":
                    raise
                return self._degraded(stage1, body.num_results, reason, err)
            response.headers[RANKER_VERSION_HEADER] = ranker_version
            return funnel.merge(stage1, ranked, task, body.num_results, ranker_version)
        except Exception as err:  # noqa: BLE001
            return error_response(err, self.retry_after_s)

    async def _stage2(self, body: RecommendBody, items, deadline: float):
        """(the task the items are ordered by; the ranker's ranking, None: no items; the ranker's version)."""
        task = funnel.check_body(body, await self._ranker(deadline))
        ranking = funnel.stage2(body, items)
        if ranking is not None:  # in the cache scope of stage 1's request (the user's, by default)
            ranking = ranking.model_copy(update={"cache_scope": cache_scope(body)})
        if ranking is None:  # nothing to rank: the answer still names the ranker's version
            info = await self._engine_call(self.handles["ranker"].model_info.remote(), deadline, "ranker", True)
            return task, None, info.version
        key = routing_key(body, ranking, self.routing_blocks)
        ranked, version = await self._call("ranker", "rank", ranking, deadline, key, fallback=True)
        return task, ranked, version

    def _degraded(self, stage1: RecommendResult, num_results: int | None, reason: str, err: Exception):
        """Stage 1's answer after stage 2 failed: counted, and logged with its traceback when it was a bug."""
        if reason == "ranker_error":
            log.error("the ranking failed unexpectedly; answered with the retrieval", exc_info=err)
        self.metrics.degraded(reason)
        return funnel.degraded(stage1, num_results, reason)

    def _deployment_of(self, kind: str) -> str:
        """The deployment that answers the kind; a 404 (not_served) when the app has none of its family."""
        target = SECTION_OF[kind]
        if self.handles[target] is None:
            present = next(name for name, handle in self.handles.items() if handle is not None)
            raise NotServed(kind, FAMILY[present], list(FAMILY_KINDS[FAMILY[present]]))
        return target

    async def _ranker(self, deadline: float) -> RankerFacts:
        """What the ranker takes: from the builder; else (its node was down at the deploy) asked once of it."""
        if self.ranker_facts is None:
            info = await self._engine_call(self.handles["ranker"].model_info.remote(), deadline, "ranker", True)
            self.ranker_facts = RankerFacts(
                tasks=info.tasks, max_history_events=info.max_history_events, max_candidates=info.max_candidates
            )
        return self.ranker_facts

    async def _call(
        self, target: str, method: str, request, deadline: float, key: str, engine_deadline=None, fallback=False
    ):
        """(result, model version) of an engine method, given until `engine_deadline` (default: the deadline less
        ANSWER_MARGIN_S); with a `fallback` (a two-stage ranking), waited for only while the target has a replica."""
        if engine_deadline is None:
            engine_deadline = deadline - ANSWER_MARGIN_S
        remaining = engine_deadline - time.monotonic()
        if remaining <= 0:
            raise RequestTimeout(f"no answer within {self.request_timeout_s:g} s ({target} not reached)")
        if fallback:
            self._check_running(target)  # before the call: none queued for a replica that is not there
        call = getattr(self.handles[target], method).remote(request, remaining, **{ROUTING_KEY: key})
        return await self._engine_call(call, deadline, target, fallback)

    def _check_running(self, target: str) -> None:
        """EngineUnavailable when this replica's router knows (replicas.live_replicas) the target has no running
        replica, so a two-stage recommend answers degraded at once instead of waiting for a replacement; not for a
        deployment that scales to zero (none running is its idle state, and the call starts one)."""
        if target in self.idle_at_zero:
            return
        handle = self.handles[target]
        if live_replicas(handle.app_name, handle.deployment_name) == frozenset():
            raise EngineUnavailable(f"{NAMES[target][1]} is unavailable (none is running); retry")

    async def _user_embedding(self, body, deadline: float) -> list[float] | None:
        """The user's vector from the cache. Without a cache the user_id only scopes and routes, and a prompt that
        needs a vector (a <|user|> placeholder, known once rendered) is the engine's 422 naming user_embedding."""
        if getattr(body, "user_embedding", None) is not None or body.user_id is None or isinstance(body, RankBody):
            return None  # an inline vector wins; no user_id, nothing to look up; a ranker takes no vector
        if self.cache_args is None:
            return None
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

    async def _engine_call(self, response, deadline: float, target: str, fallback: bool = False):
        """The engine's answer; at the deadline (less the time to answer), give up and cancel: a request waiting
        for a replica that never comes (none running, the deployment deleted or replaced) ends then too."""
        queues, replica = NAMES[target]
        timeout_s = max(0.0, deadline - ANSWER_MARGIN_S - time.monotonic())
        try:
            if not fallback:
                return await asyncio.wait_for(response, timeout_s)
            return await self._unless_gone(response, timeout_s, target)
        except RayTaskError as err:  # first: a RayTaskError wrapping the engine's RequestTimeout is a TimeoutError
            raise _cause(err) from None
        except TimeoutError:
            response.cancel()  # the engine drops the request at its next step
            raise RequestTimeout(f"no answer within {self.request_timeout_s:g} s") from None
        except BackPressureError as err:
            raise Overloaded(f"{queues} queues are full ({err})", self.retry_after_s) from None
        except (RayActorError, DeploymentUnavailableError, ReplicaUnavailableError) as err:
            raise EngineUnavailable(f"{replica} is unavailable ({type(err).__name__}); retry") from None

    async def _unless_gone(self, response, timeout_s: float, target: str):
        """The result within `timeout_s` (else TimeoutError), or EngineUnavailable as soon as the target has no
        running replica (looked at every WATCH_S): a request held by a dead replica, or awaiting one, ends then."""
        waiter = asyncio.ensure_future(response)
        end = time.monotonic() + timeout_s
        try:
            while not waiter.done():
                self._check_running(target)
                if (left := end - time.monotonic()) <= 0:
                    raise TimeoutError
                await asyncio.wait({waiter}, timeout=min(WATCH_S, left))
            return waiter.result()
        finally:
            if not waiter.done():
                waiter.cancel()
                response.cancel()
