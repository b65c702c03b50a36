"""specdec.serving.auth: API keys (flags, key file), the constant-time check, and the gRPC interceptor
over a real loopback server (guarded methods of every kind; health and reflection open)."""

from __future__ import annotations

import grpc
import pytest

from specdec.errors import AuthenticationError, ConfigError
from specdec.serving import auth
from specdec.serving.auth import ApiKeyInterceptor, ApiKeys, bearer_metadata
from specdec.serving.grpc_errors import ERROR_CLASS_KEY, error_from_rpc
from specdec.serving.server import start_server

KEYS = ["sk-one", "sk-two", "sk-three"]


# --------------------------------------------------------------------------------------------------
# keys and the check


@pytest.mark.parametrize(("header", "ok"), [
    ("Bearer sk-one", True), ("Bearer sk-two", True), ("Bearer sk-three", True),
    ("bearer sk-two", True), ("BEARER  sk-two ", True),  # the scheme is case-insensitive (RFC 7235)
    (None, False), ("", False), ("Bearer", False), ("Bearer ", False), ("sk-one", False), ("Basic sk-one", False),
    ("Bearer sk-on", False), ("Bearer sk-one2", False), ("Bearer SK-ONE", False), ("Bearer sk-one sk-two", False),
])
def test_check(header, ok):
    assert ApiKeys(KEYS).check(header) is ok


def test_no_keys_means_open():
    keys = ApiKeys.load(None)
    assert not keys and keys.check(None) and keys.check("Bearer anything")
    assert not ApiKeys.load([]) and not ApiKeys.load("") and not ApiKeys.load(["", "  "])


def test_every_key_is_compared_in_constant_time_whichever_matches(monkeypatch):
    """hmac.compare_digest on equal-length digests, once per key, with no early exit: the time taken
    does not say whether, or which, key matched."""
    calls = []
    real = auth.hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    keys = ApiKeys(KEYS)
    for header in ("Bearer sk-one", "Bearer sk-three", "Bearer nope", "Bearer a-much-longer-wrong-key", None):
        calls.clear()
        keys.check(header)
        assert calls == [(32, 32)] * len(KEYS), header


def test_load_from_flags_and_a_key_file(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# rotated 2024-06\nsk-file-1\n\n  sk-file-2  \nsk-one\n")
    keys = ApiKeys.load(["sk-one", " sk-two "], str(key_file))
    assert len(keys) == 4  # sk-one once
    for key in ("sk-one", "sk-two", "sk-file-1", "sk-file-2"):
        assert keys.check(f"Bearer {key}"), key
    assert not keys.check("Bearer # rotated 2024-06")
    assert ApiKeys.load("sk-single").check("Bearer sk-single")  # a plain string is one key


def test_bad_key_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="--api-key-file: cannot read"):
        ApiKeys.load(key_file=str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ConfigError, match="holds no key"):
        ApiKeys.load(key_file=str(empty))


# --------------------------------------------------------------------------------------------------
# the interceptor over a real loopback server


@pytest.fixture(scope="module")
def guarded():
    rejected = []

    def unary(request, context):
        return b"unary:" + request

    def stream(request, context):
        yield b"a"
        yield b"b"

    def client_stream(requests, context):
        return b"+".join(requests)

    def register(server):
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Guarded", {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
            "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
        })])

    interceptor = ApiKeyInterceptor(ApiKeys(KEYS), on_reject=rejected.append)
    handle = start_server(register, ["test.Guarded"], "127.0.0.1", 0, interceptors=[interceptor])
    handle.set_serving(True)
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    yield channel, rejected
    channel.close()
    handle.stop(0)


def _calls(channel, metadata):
    return {
        "unary": lambda: channel.unary_unary("/test.Guarded/Unary")(b"x", metadata=metadata, timeout=10),
        "stream": lambda: list(channel.unary_stream("/test.Guarded/Stream")(b"x", metadata=metadata, timeout=10)),
        "client_stream": lambda: channel.stream_unary("/test.Guarded/ClientStream")(
            iter([b"p", b"q"]), metadata=metadata, timeout=10),
    }


@pytest.mark.parametrize("metadata", [None, bearer_metadata("wrong"), (("authorization", "Basic sk-one"),),
                                      (("x-api-key", "sk-one"),)], ids=["none", "wrong", "basic", "other-header"])
def test_calls_without_a_valid_key_are_unauthenticated(guarded, metadata):
    channel, rejected = guarded
    rejected.clear()
    for name, call in _calls(channel, metadata).items():
        with pytest.raises(grpc.RpcError) as info:
            call()
        err = info.value
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, name
        assert "API key" in err.details() and dict(err.trailing_metadata())[ERROR_CLASS_KEY] == "AuthenticationError"
        assert type(error_from_rpc(err)) is AuthenticationError  # back through the one error table
    assert rejected == ["/test.Guarded/Unary", "/test.Guarded/Stream", "/test.Guarded/ClientStream"]


@pytest.mark.parametrize("key", KEYS)
def test_each_key_is_accepted(guarded, key):
    channel, _ = guarded
    results = {name: call() for name, call in _calls(channel, bearer_metadata(key)).items()}
    assert results == {"unary": b"unary:x", "stream": [b"a", b"b"], "client_stream": b"p+q"}


def test_health_and_reflection_stay_open(guarded):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    channel, rejected = guarded
    rejected.clear()
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert "test.Guarded" in set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert rejected == []


def test_an_unknown_method_is_still_unimplemented(guarded):
    channel, _ = guarded
    with pytest.raises(grpc.RpcError) as info:
        channel.unary_unary("/test.Nothing/Here")(b"x", timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
