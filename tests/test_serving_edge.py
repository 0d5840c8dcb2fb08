"""The ingress's HTTP edge without Ray (genrec.serving.edge on a bare FastAPI app, driven as ASGI): auth before the
body, a chunked body over the limit refused as it streams, a trickled body refused at its deadline, every answer
counted; and 422 messages that never show validator internals. Through Serve: tests/test_serving.py."""

import asyncio
import json
import time

import pytest
from fastapi import FastAPI

from genrec.serving import edge
from genrec.serving.schemas import RetrieveBody

MIB = 1 << 20


class EdgeApp:
    """A bare FastAPI app behind an edge of its own settings; `answered`: the (route, status) of each answer."""

    def __init__(self, **settings):
        self.answered = []
        self.settings = edge.EdgeSettings(
            body_timeout_s=0.3, routes=frozenset({"/v1/retrieve"}), answered=lambda *a: self.answered.append(a)
        )
        for name, value in settings.items():
            setattr(self.settings, name, value)

    def app(self) -> FastAPI:
        api = FastAPI()
        edge.install(api, self.settings)

        @api.post("/v1/retrieve")
        async def retrieve(body: RetrieveBody):
            return {"user_id": body.user_id}

        return api

    def call(self, path: str, chunks, headers=(), stall_after: int | None = None):
        return call(self.app(), path, chunks, headers, stall_after)


@pytest.fixture
def edge_app():
    return EdgeApp()


def call(app, path: str, chunks, headers=(), stall_after: int | None = None):
    """POST `chunks` (an iterable of bytes, read lazily) as one body; after `stall_after` chunks the client
    stops sending. Returns (status, JSON body, chunks the app read)."""
    chunks, read, sent = iter(chunks), [0], []

    async def receive():
        if stall_after is not None and read[0] >= stall_after:
            await asyncio.sleep(3600)
        chunk = next(chunks, None)
        read[0] += chunk is not None
        return {"type": "http.request", "body": chunk or b"", "more_body": chunk is not None}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))
    (start,) = [m for m in sent if m["type"] == "http.response.start"]
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body), read[0]


def test_a_chunked_body_over_the_limit_is_refused_as_it_streams(edge_app):
    """40 MiB without a Content-Length: 413 once 32 MiB have arrived; the rest is never read."""
    status, body, read = edge_app.call("/v1/retrieve", (b" " * MIB for _ in range(40)))
    assert (status, body["code"]) == (413, "too_large")
    assert read == edge.MAX_BODY_BYTES // MIB + 1
    assert edge_app.answered == [("/v1/retrieve", 413)]


def test_a_content_length_over_the_limit_is_refused_unread(edge_app):
    length = (b"content-length", str(40 * MIB).encode())
    status, body, read = edge_app.call("/v1/retrieve", (b" " * MIB for _ in range(40)), headers=[length])
    assert (status, body["code"], read) == (413, "too_large", 0)


def test_a_trickled_body_is_refused_at_its_deadline(edge_app):
    started = time.monotonic()
    status, body, read = edge_app.call("/v1/retrieve", [b'{"prompt": "user', b" listened"], stall_after=1)
    assert (status, body["code"]) == (408, "timeout") and "0.3 s" in body["message"]
    assert 0.3 <= time.monotonic() - started < 10 and read == 1
    status, _, _ = edge_app.call("/v1/retrieve", [b'{"prompt": "user', b' listened"}'])  # in time: served
    assert status == 200 and edge_app.answered == [("/v1/retrieve", 408), ("/v1/retrieve", 200)]


def test_auth_is_checked_before_the_body_is_read():
    edge_app = EdgeApp(token=b"s3cret")
    status, body, read = edge_app.call("/v1/retrieve", [b'{"prompt": "x"}'], stall_after=0)  # the body never comes
    assert (status, body["code"], read) == (401, "unauthorized", 0)
    wrong = [(b"authorization", b"Bearer s3cre")]
    assert edge_app.call("/v1/retrieve", [b'{"prompt": "x"}'], headers=wrong)[:1] == (401,)
    right = [(b"authorization", b"Bearer s3cret")]
    assert edge_app.call("/v1/retrieve", [b'{"prompt": "x"}'], headers=right)[:2] == (200, {"user_id": None})
    status, _, read = edge_app.call("/healthz", [b""], stall_after=0)  # no token needed off /v1/ (404 here: no route)
    assert (status, read) == (404, 0)
    assert edge_app.answered[-1] == ("other", 404)  # a path that is not a route is counted as "other"


RIGHT, WRONG = (b"authorization", b"Bearer s3cret"), (b"Authorization", b"Bearer wrong")


@pytest.mark.parametrize(
    "headers", [[WRONG, RIGHT], [RIGHT, WRONG], [RIGHT, RIGHT]], ids=["wrong-first", "right-first", "twice"]
)
def test_two_authorization_headers_are_refused_whichever_comes_first(headers):
    """A proxy in front may read the first header and this edge another: with two, neither is taken."""
    edge_app = EdgeApp(token=b"s3cret")
    status, body, read = edge_app.call("/v1/retrieve", [b'{"prompt": "x"}'], headers=headers, stall_after=0)
    assert (status, body["code"], read) == (401, "unauthorized", 0)
    assert "more than one 'Authorization' header" in body["message"]
    assert edge_app.call("/v1/retrieve", [b'{"prompt": "x"}'], headers=[RIGHT])[0] == 200  # one right header passes


INTERNALS = ("function", "0x", "functools", "partial", "<", "constrained", "validator")
BAD_USER_IDS = {
    "too long": '"' + "u" * 300 + '"',
    "lone surrogate": '"\\ud800"',
    "float": "1.5",
    "bool": "true",
    "-2^63": str(-(2**63)),
    "2^63": str(2**63),
    "list": '["a"]',
}


@pytest.mark.parametrize("user_id", BAD_USER_IDS.values(), ids=BAD_USER_IDS.keys())
def test_a_bad_user_id_is_a_422_without_validator_internals(edge_app, user_id):
    status, body, _ = edge_app.call("/v1/retrieve", [f'{{"prompt": "x", "user_id": {user_id}}}'.encode()])
    assert status == 422 and body["code"] == "invalid_request"
    (detail,) = body["details"]  # one problem, not one per member of the union
    assert detail["field"].startswith("user_id")
    text = json.dumps(body)
    assert not [word for word in INTERNALS if word in text], text
