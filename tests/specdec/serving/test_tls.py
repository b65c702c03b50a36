"""specdec.serving.tls with specdec.serving.server over real loopback servers: TLS and mutual TLS
accept the clients they should and refuse the others (plaintext, no client certificate, another CA,
a wrong server name); bad TLS settings are ConfigErrors naming the flag, raised at start-up."""

from __future__ import annotations

import grpc
import pytest

from specdec.errors import ConfigError
from specdec.serving.server import start_server
from specdec.serving.tls import PLAINTEXT, channel_security, server_credentials
from tests.tls_helpers import SERVER_NAME

HOST = "127.0.0.1"


def _register(server: grpc.Server) -> None:
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Echo", {
        "Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: b"echo:" + request)})])


def _start(credentials):
    return start_server(_register, ["test.Echo"], HOST, 0, credentials=credentials)


def _echo(security, port: int, address: str = HOST) -> bytes:
    with security.channel(f"{address}:{port}") as channel:
        return channel.unary_unary("/test.Echo/Echo")(b"hi", timeout=10)


def _refused(security, port: int, address: str = HOST) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _echo(security, port, address)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value  # no connection: the handshake failed


@pytest.fixture(scope="module")
def tls_server(pki):
    handle = _start(server_credentials(pki.server_cert, pki.server_key))
    yield handle
    handle.stop(0)


@pytest.fixture(scope="module")
def mtls_server(pki):
    handle = _start(server_credentials(pki.server_cert, pki.server_key, pki.ca))
    yield handle
    handle.stop(0)


# --------------------------------------------------------------------------------------------------
# TLS


def test_tls_server_serves_a_client_that_trusts_its_ca(pki, tls_server):
    security = channel_security(ca_file=pki.ca)
    assert security.tls
    assert _echo(security, tls_server.port) == b"echo:hi"
    assert _echo(security, tls_server.port, "localhost") == b"echo:hi"


def test_tls_server_refuses_a_plaintext_client(tls_server):
    _refused(PLAINTEXT, tls_server.port)


def test_a_client_refuses_a_server_signed_by_a_ca_it_does_not_trust(pki, tls_server):
    _refused(channel_security(ca_file=pki.other_ca), tls_server.port)


def test_a_tls_client_refuses_a_plaintext_server(pki):
    handle = _start(None)
    try:
        assert _echo(PLAINTEXT, handle.port) == b"echo:hi"
        _refused(channel_security(ca_file=pki.ca), handle.port)
    finally:
        handle.stop(0)


def test_server_name_override_is_checked_against_the_certificate(pki, tls_server):
    assert _echo(channel_security(ca_file=pki.ca, server_name=SERVER_NAME), tls_server.port) == b"echo:hi"
    _refused(channel_security(ca_file=pki.ca, server_name="not-the-server"), tls_server.port)


# --------------------------------------------------------------------------------------------------
# mutual TLS


def test_mtls_server_serves_a_client_with_a_certificate_from_its_ca(pki, mtls_server):
    security = channel_security(pki.ca, pki.client_cert, pki.client_key)
    assert _echo(security, mtls_server.port) == b"echo:hi"


def test_mtls_server_refuses_a_client_without_a_certificate(pki, mtls_server):
    _refused(channel_security(ca_file=pki.ca), mtls_server.port)
    _refused(PLAINTEXT, mtls_server.port)


def test_mtls_server_refuses_a_certificate_from_another_ca(pki, mtls_server):
    _refused(channel_security(pki.ca, pki.other_client_cert, pki.other_client_key), mtls_server.port)


def test_a_plain_tls_server_ignores_a_client_certificate(pki, tls_server):
    assert _echo(channel_security(pki.ca, pki.client_cert, pki.client_key), tls_server.port) == b"echo:hi"


# --------------------------------------------------------------------------------------------------
# settings


def test_no_tls_settings_mean_plaintext():
    assert server_credentials(None, None) is None
    assert channel_security() is PLAINTEXT and not PLAINTEXT.tls


@pytest.mark.parametrize(("which", "match"), [
    ("cert-only", "--tls-cert-file needs --tls-key-file"),
    ("key-only", "--tls-key-file needs --tls-cert-file"),
    ("ca-only", "--tls-client-ca-file needs --tls-cert-file and --tls-key-file"),
    ("missing", "--tls-cert-file: cannot read '/nonexistent/cert.pem'"),
    ("mismatch", "do not make a certificate and its key"),
    ("not-pem", "--tls-client-ca-file: .* is not a PEM file"),
    ("key-as-ca", "--tls-client-ca-file: .* holds no usable CA certificate"),
])
def test_bad_server_settings_are_config_errors_naming_the_flag(pki, tmp_path, which, match):
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    args = {
        "cert-only": (pki.server_cert, None, None),
        "key-only": (None, pki.server_key, None),
        "ca-only": (None, None, pki.ca),
        "missing": ("/nonexistent/cert.pem", pki.server_key, None),
        "mismatch": (pki.server_cert, pki.client_key, None),
        "not-pem": (pki.server_cert, pki.server_key, str(not_pem)),
        "key-as-ca": (pki.server_cert, pki.server_key, pki.server_key),
    }[which]
    with pytest.raises(ConfigError, match=match):
        server_credentials(*args)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"cert_file": "C"}, "--backend-tls-cert-file needs --backend-tls-key-file"),
    ({"server_name": "x"}, "--backend-tls-server-name needs TLS"),
    ({"ca_file": "/nonexistent/ca.pem"}, "--backend-tls-ca-file: cannot read"),
])
def test_bad_client_settings_are_config_errors_naming_the_flag(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        channel_security(**kwargs)


def test_client_key_pair_is_checked(pki):
    with pytest.raises(ConfigError, match="--backend-tls-cert-file .* --backend-tls-key-file .* do not make"):
        channel_security(pki.ca, pki.client_cert, pki.server_key)
