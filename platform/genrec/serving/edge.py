"""The ingress's HTTP edge (docs/serving.md, "The HTTP edge"): an ASGI middleware that checks auth before a body
is read, refuses a body over the limit (413, by Content-Length or counted as it streams) or slower than
`body_timeout_s` (408), counts every answer by route and status, and records when the request arrived
(`arrived`: its deadline counts from then, the body's reading included).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field

from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from genrec.serving.http_errors import (
    TooLarge,
    Unauthorized,
    error_response,
    http_error_handler,
    validation_error_handler,
)

_ARRIVED: ContextVar[float | None] = ContextVar("genrec_arrived", default=None)
MAX_BODY_BYTES = 32 << 20  # far above any valid request (the longest prompt as token IDs is < 1 MiB)
AUTH_PREFIX = "/v1/"  # routes that need the token (when auth is on); /healthz and the docs do not


@dataclass
class EdgeSettings:
    """What the edge enforces: each app's own (`install`), never a process-wide setting."""

    token: bytes | None = None  # None: auth off
    body_timeout_s: float = 10.0
    max_body_bytes: int = MAX_BODY_BYTES
    routes: frozenset[str] = frozenset()  # the app's paths (for requests refused before routing; see _route)
    answered: Callable[[str, int], None] = field(default=lambda route, status: None)


def arrived() -> float:
    """When the request being served reached the edge (time.monotonic(); outside a request: now)."""
    found = _ARRIVED.get()
    return time.monotonic() if found is None else found


def install(app: FastAPI, settings: EdgeSettings) -> None:
    """genrec's error bodies and this edge on a FastAPI app, before it serves its first request."""
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_middleware(Edge, settings=settings)


class Edge:
    """ASGI middleware: `app.add_middleware(Edge, settings=...)`."""

    def __init__(self, app, settings: EdgeSettings):
        self.app, self.settings = app, settings

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        settings, path = self.settings, _app_path(scope)
        status = 500  # if nothing was sent: the client saw the connection fail
        arrival = _ARRIVED.set(time.monotonic())  # the route runs in this context: it reads when the request came

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = _refusal(scope, path, settings)
            if refusal is not None:
                await refusal(scope, receive, counted)
            else:
                await self.app(scope, _Body(receive, settings), counted)
        finally:
            settings.answered(_route(scope, path, settings), status)
            _ARRIVED.reset(arrival)


def _refusal(scope, path: str, settings: EdgeSettings):
    """The answer to a request refused on its headers alone (None: let it in)."""
    headers = dict(scope.get("headers", ()))
    if settings.token is not None and path.startswith(AUTH_PREFIX):
        # One Authorization header, or none: with two, a proxy in front that reads the first and this edge (which
        # would read the last) could each let in what the other refuses.
        if sum(name.lower() == b"authorization" for name, _ in scope.get("headers", ())) > 1:
            return error_response(Unauthorized("more than one 'Authorization' header: send one, 'Bearer <token>'"))
        scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        # constant time: the token does not leak by timing
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("latin-1"), settings.token):
            return error_response(Unauthorized("a valid 'Authorization: Bearer <token>' header is required"))
    length = headers.get(b"content-length", b"").decode("latin-1")
    if length.isdigit() and int(length) > settings.max_body_bytes:
        return error_response(TooLarge(f"request body of {length} bytes exceeds {settings.max_body_bytes} bytes"))
    return None


class _Body:
    """The app's `receive`: the body counted and timed (messages after its last one pass untimed). A refusal is an
    HTTPException, which FastAPI's body reading passes to http_errors.http_error_handler (the JSON body)."""

    def __init__(self, receive, settings: EdgeSettings):
        self.receive, self.settings = receive, settings
        self.deadline = arrived() + settings.body_timeout_s
        self.size, self.done = 0, False

    async def __call__(self):
        if self.done:
            return await self.receive()
        try:
            message = await asyncio.wait_for(self.receive(), max(0.0, self.deadline - time.monotonic()))
        except TimeoutError:
            limit = self.settings.body_timeout_s
            raise HTTPException(408, f"the request body did not arrive within {limit:g} s") from None
        if message["type"] == "http.request":
            self.size += len(message.get("body", b""))
            if self.size > self.settings.max_body_bytes:
                raise HTTPException(413, f"request body exceeds {self.settings.max_body_bytes} bytes")
            self.done = not message.get("more_body", False)
        else:  # http.disconnect: the client is gone
            self.done = True
        return message


def _route(scope, path: str, settings: EdgeSettings) -> str:
    """The metrics' route tag: the matched route, else the path if it is the app's, else "other" (a bounded set)."""
    matched = getattr(scope.get("route"), "path", None)
    if isinstance(matched, str):
        return matched
    return path if path in settings.routes else "other"


def _app_path(scope) -> str:
    """The request's path within the app (Serve mounts an app under its route prefix, the scope's root_path)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path
