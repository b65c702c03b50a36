"""The one error table (specdec.errors): every domain error crosses gRPC and the OpenAI HTTP layer as
the table says, and the gateway's client side turns the status back into the same error.

gRPC: a real loopback server whose servicer raises each error (``map_errors``); the client reads the
status and rebuilds the error (``error_from_rpc``). HTTP: the gateway's real FastAPI app on uvicorn,
whose request handling raises the rebuilt error; the client reads OpenAI's error body.
"""

from __future__ import annotations

import grpc
import pytest

from gateway.config import GatewayConfig
from specdec import errors
from specdec.errors import DOMAIN_ERRORS, SpecDecError, error_from_code
from specdec.serving.grpc_errors import ERROR_CLASS_KEY, error_from_rpc, map_errors
from specdec.serving.server import start_server
from tests.gateway.openai.http_helpers import httpx

USER_MISTAKES = (errors.InvalidRequestError, errors.ConfigError, errors.ModelNotFoundError, errors.AuthenticationError)


def _all_subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _all_subclasses(sub)
    return out


def test_every_domain_error_class_has_a_row():
    declared = {c for c in _all_subclasses(SpecDecError) if c.__module__ == "specdec.errors"}
    assert declared == set(DOMAIN_ERRORS)
    for cls in DOMAIN_ERRORS:
        assert grpc.StatusCode[cls.grpc_code] not in (grpc.StatusCode.OK, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
        assert 400 <= cls.http_status < 600 and cls.openai_type
    for cls in USER_MISTAKES:  # a user's mistake is never a 5xx
        assert 400 <= cls.http_status < 500, cls


def test_a_bare_status_code_turns_into_the_first_class_with_it():
    assert type(error_from_code("NOT_FOUND", "x")) is errors.SequenceNotFoundError  # the protocol's meaning
    assert type(error_from_code("FAILED_PRECONDITION", "x")) is errors.ModelLoadError  # a backend that cannot serve
    assert type(error_from_code("NOT_FOUND", "x", "ModelNotFoundError")) is errors.ModelNotFoundError
    assert type(error_from_code("INTERNAL", "x")) is SpecDecError
    # a class name that does not match the code is not trusted
    assert type(error_from_code("INVALID_ARGUMENT", "x", "ModelLoadError")) is errors.InvalidRequestError


class _Raiser:
    @map_errors
    def Unary(self, request: bytes, context):
        raise getattr(errors, request.decode())(f"{request.decode()}: here is what to fix")


@pytest.fixture(scope="module")
def grpc_channel():
    servicer = _Raiser()

    def register(server):
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Errors", {
            "Unary": grpc.unary_unary_rpc_method_handler(servicer.Unary)})])

    handle = start_server(register, ["test.Errors"], "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    yield channel
    channel.close()
    handle.stop(0)


class _RaisingGateway:
    """What the HTTP app needs of a Gateway; checking the request's k raises the error under test."""

    model_name = "m"
    max_model_len = 64
    error: BaseException | None = None
    config = GatewayConfig()

    def resolve_k(self, k):
        raise self.error


@pytest.fixture(scope="module")
def http():
    from gateway.openai.api_server import HttpServer, create_app

    gateway = _RaisingGateway()
    server = HttpServer(create_app(gateway), "127.0.0.1", 0)
    client = httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=30)
    yield gateway, client
    client.close()
    server.stop()


@pytest.mark.parametrize("cls", DOMAIN_ERRORS, ids=lambda c: c.__name__)
def test_each_error_through_grpc_and_http(grpc_channel, http, cls):
    with pytest.raises(grpc.RpcError) as info:
        grpc_channel.unary_unary("/test.Errors/Unary")(cls.__name__.encode(), timeout=10)
    err = info.value
    assert err.code() == grpc.StatusCode[cls.grpc_code]
    assert err.details() == f"{cls.__name__}: here is what to fix"
    assert dict(err.trailing_metadata())[ERROR_CLASS_KEY] == cls.__name__
    rebuilt = error_from_rpc(err, "target service: ")
    assert type(rebuilt) is cls and str(rebuilt) == f"target service: {cls.__name__}: here is what to fix"

    gateway, client = http
    gateway.error = rebuilt
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert response.status_code == cls.http_status, response.text
    body = response.json()["error"]
    assert (body["type"], body["code"]) == (cls.openai_type, cls.openai_code)
    assert body["message"] == str(rebuilt)


class _Bug:
    @map_errors
    def Unary(self, request: bytes, context):
        raise RuntimeError(f"boom while handling {request.decode()!r}")


INTERNAL_MESSAGE = "internal error (RuntimeError); see the server log"


def test_an_unexpected_exception_is_internal_on_both_sides(http, caplog):
    """Its type reaches the client, never its message (which may quote the prompt) or its trace;
    the trace is in the server log."""
    servicer = _Bug()
    handle = start_server(lambda server: server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "test.Bug", {"Unary": grpc.unary_unary_rpc_method_handler(servicer.Unary)})]), ["test.Bug"], "127.0.0.1", 0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel, pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/test.Bug/Unary")(b"my secret prompt", timeout=10)
    finally:
        handle.stop(0)
    assert info.value.code() == grpc.StatusCode.INTERNAL and info.value.details() == INTERNAL_MESSAGE
    rebuilt = error_from_rpc(info.value, "target service: ")  # what the gateway then tells its client
    assert type(rebuilt) is SpecDecError and str(rebuilt) == f"target service: {INTERNAL_MESSAGE}"

    gateway, client = http
    close = {"Connection": "close"}  # uvicorn drops a connection whose request raised: one per request
    for error in (RuntimeError("boom while handling 'my secret prompt'"), rebuilt):
        gateway.error = error
        response = client.post("/v1/completions", json={"prompt": "my secret prompt", "max_tokens": 1}, headers=close)
        assert response.status_code == 500 and response.json()["error"]["type"] == "internal_error"
        assert "secret" not in response.text and "Traceback" not in response.text
    gateway.error = RuntimeError("boom")
    with caplog.at_level("ERROR", logger="gateway.openai.protocol"):
        response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=close)
    assert response.json()["error"]["message"] == INTERNAL_MESSAGE
    assert "Traceback" in caplog.text and "RuntimeError: boom" in caplog.text  # the server log has it all
