"""Every way a request can fail, as an HTTP status and a JSON body (docs/serving.md, "Errors"). Only a bug is a
500: logged with its traceback, answered without internals.
"""

from __future__ import annotations

import logging
import math

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from genrec.api import located_error
from genrec.errors import EngineStopped, GenrecError, InvalidRequestError, Overloaded, RequestTimeout
from genrec.serving.schemas import ErrorBody, ErrorDetail

log = logging.getLogger(__name__)
BODY = "body"  # the field a 400 or 422 names when the body as a whole is at fault


class Unauthorized(GenrecError):
    """Missing or wrong bearer token."""


class UnknownUser(GenrecError):
    """A user_id with no stored embedding (and no inline user_embedding)."""

    def __init__(self, user_id):
        super().__init__(f"user_id {user_id!r} has no stored embedding; send user_embedding inline or load it first")
        self.user_id = user_id


class NotServed(GenrecError):
    """A route of the other model family: this deployment's model does not answer that kind of request."""

    outcome = "invalid"

    def __init__(self, kind: str, family: str, serves: list[str]):
        routes = ", ".join(f"/v1/{k}" for k in serves)
        super().__init__(f"this deployment serves a {family} model, which answers {routes}; not /v1/{kind}")
        self.kind, self.family, self.serves = kind, family, list(serves)

    def __reduce__(self):  # raised in an engine replica, read in the ingress: rebuilt from its fields
        return type(self), (self.kind, self.family, self.serves)


class TooLarge(GenrecError):
    """A request body over the ingress's limit (edge.MAX_BODY_BYTES)."""


class EngineUnavailable(GenrecError):
    """The engine replica, or the embedding cache, died or is being replaced: retry shortly."""


class CatalogNotServed(GenrecError):
    """A retriever replica without its declared catalog answers nothing rather than another catalog: retry."""

    outcome = "catalog_not_served"

    def __init__(self, catalog: str | None, why: str):
        super().__init__(f"catalog not served: {catalog or 'the one its user_config declares'} ({why})")
        self.catalog, self.why = catalog, why

    def __reduce__(self):  # raised in an engine replica, read in the ingress: rebuilt from its fields
        return type(self), (self.catalog, self.why)


# What `_classify` answers with a 4xx: the client's mistake, whichever deployment caught it.
CLIENT_ERRORS = (InvalidRequestError, ValidationError, Unauthorized, UnknownUser, NotServed, TooLarge)


def is_client_error(error: BaseException) -> bool:
    return isinstance(error, CLIENT_ERRORS)


def error_response(error: BaseException, retry_after_s: float = 1.0) -> JSONResponse:
    status, body, headers = _classify(error, retry_after_s)
    return JSONResponse(ErrorBody(**body).model_dump(), status_code=status, headers=headers)


def _classify(error: BaseException, retry_after_s: float) -> tuple[int, dict, dict]:
    retry = {"Retry-After": str(max(1, math.ceil(retry_after_s)))}
    if isinstance(error, InvalidRequestError):
        detail = ErrorDetail(field=error.field or BODY, message=error.problem)
        return 422, {"code": "invalid_request", "message": str(error), "details": [detail]}, {}
    if isinstance(error, ValidationError):  # a request rebuilt in the ingress (e.g. with a cached embedding)
        return 422, _invalid(error.errors()).model_dump(), {}
    if isinstance(error, Unauthorized):
        return 401, {"code": "unauthorized", "message": str(error)}, {"WWW-Authenticate": "Bearer"}
    if isinstance(error, UnknownUser):
        detail = ErrorDetail(field="user_id", message=str(error))
        return 404, {"code": "unknown_user", "message": str(error), "details": [detail]}, {}
    if isinstance(error, NotServed):
        return 404, {"code": "not_served", "message": str(error)}, {}
    if isinstance(error, TooLarge):
        return 413, {"code": "too_large", "message": str(error)}, {}
    if isinstance(error, Overloaded):  # the deployment's configured Retry-After, wherever the queue was full
        return 503, {"code": "overloaded", "message": str(error)}, retry
    if isinstance(error, EngineStopped | EngineUnavailable):
        return 503, {"code": "unavailable", "message": str(error)}, retry
    if isinstance(error, CatalogNotServed):
        return 503, {"code": "catalog_not_served", "message": str(error)}, retry
    if isinstance(error, RequestTimeout):
        return 504, {"code": "timeout", "message": str(error)}, {}
    log.error("request failed unexpectedly", exc_info=error)
    return 500, {"code": "internal", "message": f"internal error ({type(error).__name__}); it was logged"}, {}


async def validation_error_handler(request: Request, error: RequestValidationError) -> JSONResponse:
    """FastAPI's own validation of the body: one detail per field, 400 for unparsable JSON, else 422."""
    malformed = any(e.get("type") == "json_invalid" for e in error.errors())
    field = getattr(request.scope.get("route"), "body_field", None)  # the route's request model, if it has one
    model = getattr(getattr(field, "field_info", None), "annotation", None)
    body = _invalid(error.errors(), request.headers.get("content-type"), model)
    return JSONResponse(body.model_dump(), status_code=400 if malformed else 422)


def _invalid(errors, content_type: str | None = None, model=None) -> ErrorBody:
    """Pydantic's errors as genrec's body, from each error's field and message (str() shows validators' reprs);
    `content_type`: the request's, which a body not read as JSON is answered with; `model`: the request model."""
    model = model if isinstance(model, type) and issubclass(model, BaseModel) else None
    details = [_detail(e, content_type, model) for e in errors]
    message = "; ".join(f"{d.field}: {d.message}" for d in details)
    return ErrorBody(code="invalid_request", message=message or "invalid request", details=details)


async def http_error_handler(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """Errors Starlette/FastAPI raise themselves (an unparsable body, a wrong method...): the same JSON shape. Its
    400 is a body FastAPI could not decode (not UTF-8, UTF-16 or UTF-32): named `body`, as every 400 is."""
    codes = {401: "unauthorized", 404: "not_found", 405: "method_not_allowed", 408: "timeout", 413: "too_large"}
    message, details = str(error.detail), []
    if error.status_code == 400:
        details = [ErrorDetail(field=BODY, message="is not JSON text: send a JSON object, UTF-8 encoded")]
        message = f"{BODY}: {details[0].message}"
    body = ErrorBody(code=codes.get(error.status_code, "invalid_request"), message=message, details=details)
    return JSONResponse(body.model_dump(), status_code=error.status_code, headers=error.headers)


def _detail(error: dict, content_type: str | None = None, model=None) -> ErrorDetail:
    """The field and what is wrong with it in genrec's words (api.located_error); a dict key's error names the key;
    a problem with no field (the body's own, or a check across fields) names the body."""
    if error.get("type") == "json_invalid":  # its loc is a character position, not a field
        position = error.get("loc", ("", "?"))[-1]
        why = (error.get("ctx") or {}).get("error") or error.get("msg", "")
        return ErrorDetail(field=BODY, message=f"malformed JSON at character {position}: {why}")
    loc = tuple(error.get("loc", ()))
    if loc == (BODY,) and error.get("type") in NOT_AN_OBJECT:
        return ErrorDetail(field=BODY, message=_not_an_object(error, content_type))
    field, message = located_error({**error, "loc": loc[1:] if loc[:1] == (BODY,) else loc}, model)  # less "body"
    return ErrorDetail(field=field or BODY, message=message)


# FastAPI's errors for a body that is not a JSON object: none (missing), or another JSON value, or bytes (a body
# whose Content-Type is not JSON, which FastAPI does not parse).
NOT_AN_OBJECT = ("missing", "model_attributes_type", "model_type", "dict_type")
# What a JSON value is called, in the order it is told apart (a bool is an int in Python).
JSON_KINDS = ((bool, "true or false"), (int | float, "a number"), (str, "a string"), (list, "an array"))


def _not_an_object(error: dict, content_type: str | None) -> str:
    """`must be a JSON object...; got an array`: what the body was instead."""
    value = error.get("input")
    if isinstance(value, bytes):
        sent = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        return f"must be a JSON object, sent with Content-Type 'application/json'; got {sent}"
    if error.get("type") == "missing":
        got = "an empty body"
    elif value is None:
        got = "null"
    else:
        got = next((name for kind, name in JSON_KINDS if isinstance(value, kind)), type(value).__name__)
    return f"must be a JSON object of the request's fields; got {got}"
