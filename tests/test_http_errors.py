"""FastAPI's own validation errors in genrec's JSON shape (no Ray: a bare FastAPI app with the handler)."""

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from pydantic import BaseModel

from genrec.serving.http_errors import validation_error_handler


class Body(BaseModel):
    beam_width: int


def post(content: bytes):
    app = FastAPI()
    app.add_exception_handler(RequestValidationError, validation_error_handler)

    @app.post("/v1/retrieve")
    def retrieve(body: Body):
        return {}

    return TestClient(app).post("/v1/retrieve", content=content, headers={"content-type": "application/json"})


def test_malformed_json_is_400_with_its_position_not_a_field():
    response = post(b'{"beam_width": ')
    assert response.status_code == 400
    (detail,) = response.json()["details"]
    assert detail["field"] is None and detail["message"].startswith("malformed JSON at character 15")


def test_a_bad_field_is_422_naming_it():
    response = post(b'{"beam_width": "wide"}')
    assert response.status_code == 422
    assert [d["field"] for d in response.json()["details"]] == ["beam_width"]
