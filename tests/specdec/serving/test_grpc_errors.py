"""specdec.serving.grpc_errors and specdec.serving.server over a real loopback server: status codes from
the error table, the servicer decorators, deadlines, health and reflection, stop."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from specdec.errors import (
    AuthenticationError,
    BackendUnavailableError,
    ConfigError,
    DeadlineExceededError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
    ResourceExhaustedError,
    SequenceNotFoundError,
)
from specdec.serving.backend_service import require_ready
from specdec.serving.grpc_errors import map_errors, map_stream_errors, status_code_for
from specdec.serving.server import start_server, time_remaining


# --------------------------------------------------------------------------------------------------
# error codes


@pytest.mark.parametrize(("exc", "code"), [
    (InvalidRequestError("x", param="p"), grpc.StatusCode.INVALID_ARGUMENT),
    (SequenceNotFoundError("x"), grpc.StatusCode.NOT_FOUND),
    (ResourceExhaustedError("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (BackendUnavailableError("x"), grpc.StatusCode.UNAVAILABLE),
    (ModelNotFoundError("x"), grpc.StatusCode.NOT_FOUND),
    (ModelLoadError("x"), grpc.StatusCode.FAILED_PRECONDITION),
    (DeadlineExceededError("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (AuthenticationError("x"), grpc.StatusCode.UNAUTHENTICATED),
    (ConfigError("x"), grpc.StatusCode.FAILED_PRECONDITION),
    (TimeoutError("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (futures.TimeoutError(), grpc.StatusCode.DEADLINE_EXCEEDED),
    (ValueError("x"), grpc.StatusCode.INTERNAL),       # a plain ValueError is a bug, not the caller's
    (KeyError("x"), grpc.StatusCode.INTERNAL),
    (RuntimeError("x"), grpc.StatusCode.INTERNAL),
])
def test_status_code_for(exc, code):
    assert status_code_for(exc) == code


def test_sequence_not_found_message_is_not_quoted():
    assert str(SequenceNotFoundError("target: sequence 'a' lost")) == "target: sequence 'a' lost"


# --------------------------------------------------------------------------------------------------
# the decorators and server helpers over a real loopback server


class _Servicer:
    def __init__(self):
        self.ready = threading.Event()

    @map_errors
    def Unary(self, request: bytes, context):
        what = request.decode()
        if what == "ok":
            return b"fine"
        if what == "deadline":
            left = time_remaining(context)
            return b"none" if left is None else f"{left:.3f}".encode()
        if what == "not-ready":
            require_ready(self)
            return b"ready"
        raise {
            "invalid": InvalidRequestError("max_tokens must be >= 1", param="max_tokens"),
            "notfound": SequenceNotFoundError("resend the history"),
            "exhausted": ResourceExhaustedError("cap 3 reached"),
            "timeout": TimeoutError("too slow"),
            "bug": RuntimeError("boom"),
        }[what]

    @map_stream_errors
    def Stream(self, request: bytes, context):
        yield b"one"
        yield b"two"
        if request == b"fail":
            raise InvalidRequestError("bad in the middle", param="x")
        if request == b"bug":
            raise RuntimeError("kaboom")


@pytest.fixture(scope="module")
def loopback():
    servicer = _Servicer()

    def register(server):
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Svc", {
            "Unary": grpc.unary_unary_rpc_method_handler(servicer.Unary),
            "Stream": grpc.unary_stream_rpc_method_handler(servicer.Stream),
        })])

    handle = start_server(register, ["test.Svc"], "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    yield handle, channel, servicer
    channel.close()
    handle.stop(0)


def _unary(channel, what: str, timeout=10):
    return channel.unary_unary("/test.Svc/Unary")(what.encode(), timeout=timeout)


@pytest.mark.parametrize(("what", "code", "details"), [
    ("invalid", grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1"),
    ("notfound", grpc.StatusCode.NOT_FOUND, "resend the history"),
    ("exhausted", grpc.StatusCode.RESOURCE_EXHAUSTED, "cap 3 reached"),
    ("timeout", grpc.StatusCode.DEADLINE_EXCEEDED, "too slow"),
    ("bug", grpc.StatusCode.INTERNAL, "internal error (RuntimeError); see the server log"),  # not its message
])
def test_map_errors_over_grpc(loopback, what, code, details):
    _, channel, _ = loopback
    with pytest.raises(grpc.RpcError) as info:
        _unary(channel, what)
    assert info.value.code() == code and info.value.details() == details
    assert _unary(channel, "ok") == b"fine"


def test_require_ready_inside_map_errors_is_unavailable(loopback):
    """BUG: context.abort() raises a plain Exception, which map_errors catches and re-aborts as
    INTERNAL ("internal error (Exception)"); require_ready's UNAVAILABLE never reaches the client."""
    _, channel, servicer = loopback
    servicer.ready.clear()
    with pytest.raises(grpc.RpcError) as info:
        _unary(channel, "not-ready")
    servicer.ready.set()
    assert _unary(channel, "not-ready") == b"ready"
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")


def test_map_stream_errors_over_grpc(loopback):
    _, channel, _ = loopback
    call = channel.unary_stream("/test.Svc/Stream")
    assert list(call(b"ok", timeout=10)) == [b"one", b"two"]
    got = []
    with pytest.raises(grpc.RpcError) as info:
        for msg in call(b"fail", timeout=10):
            got.append(msg)
    assert got == [b"one", b"two"]  # what was streamed before the error arrives first
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details() == "bad in the middle"
    with pytest.raises(grpc.RpcError) as info:
        list(call(b"bug", timeout=10))
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "internal error (RuntimeError); see the server log"


def test_an_unexpected_error_is_logged_with_its_trace_and_not_sent(loopback, caplog):
    """The client gets the exception's type only; the server log has the whole trace, and a log line
    that names the method, not the request."""
    _, channel, _ = loopback
    with caplog.at_level("ERROR", logger="specdec.serving.grpc_errors"), pytest.raises(grpc.RpcError) as info:
        _unary(channel, "bug")
    assert "boom" not in info.value.details() and "Traceback" not in info.value.details()
    (record,) = [r for r in caplog.records if r.name == "specdec.serving.grpc_errors"]
    assert record.getMessage() == "Unary failed: unexpected RuntimeError"
    assert record.exc_info and "RuntimeError: boom" in caplog.text and "Traceback" in caplog.text


def test_time_remaining_reports_the_client_deadline(loopback):
    _, channel, _ = loopback
    left = float(_unary(channel, "deadline", timeout=5))
    assert 0 < left <= 5.1  # grpc rounds deadlines a little
    assert _unary(channel, "deadline", timeout=None) == b"none"


def test_health_follows_set_serving_and_reflection_lists_services(loopback):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    handle, channel, _ = loopback
    health = health_pb2_grpc.HealthStub(channel)

    def status(service=""):
        return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    assert status() == status("test.Svc") == health_pb2.HealthCheckResponse.NOT_SERVING  # start_server default
    handle.set_serving(True)
    assert status() == status("test.Svc") == health_pb2.HealthCheckResponse.SERVING
    handle.set_serving(False)
    assert status("test.Svc") == health_pb2.HealthCheckResponse.NOT_SERVING
    services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"test.Svc", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services


def test_stop_runs_on_stop_callbacks_and_frees_the_port():
    calls = []
    handle = start_server(lambda s: None, ["x.Y"], "127.0.0.1", 0)
    handle.on_stop.append(lambda: calls.append("closed"))
    port = handle.port
    with pytest.raises((OSError, RuntimeError), match=str(port)):  # the port is taken while it runs
        start_server(lambda s: None, ["x.Y"], "127.0.0.1", port)
    handle.stop(0)
    assert calls == ["closed"]
    again = start_server(lambda s: None, ["x.Y"], "127.0.0.1", port)  # same port, right after
    assert again.port == port
    again.stop(0)
