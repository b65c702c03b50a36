"""TLS and mutual TLS on every gRPC hop, over real loopback servers: client → gateway (TLS) → draft and
target (mutual TLS, the gateway presenting its client certificate). A generation through it equals
the plaintext stack's; plaintext clients, clients without a certificate and certificates from another
CA are refused; bad TLS settings stop the gateway before it contacts anything. HTTPS with client
certificates (--ssl-ca-certs, --ssl-cert-reqs, as vLLM's): required, a client without a certificate from
that CA fails the handshake; optional, only a certificate from another CA does."""

from __future__ import annotations

import ssl

import pytest

from specdec.errors import BackendUnavailableError, ConfigError
from specdec.serving.tls import PLAINTEXT, channel_security
from specdec.v1 import generation_service_pb2_grpc
from tests.gateway.openai.http_helpers import httpx
from tests.services_conftest_helpers import HOST, PROMPTS, SERVING, generate, generate_request, health_status, rpc_error

N = 16


def _server_tls(pki, mutual: bool = True) -> dict:
    return {"tls_cert_file": pki.server_cert, "tls_key_file": pki.server_key,
            "tls_client_ca_file": pki.ca if mutual else None}


def _gateway_client_tls(pki) -> dict:
    return {"backend_tls_ca_file": pki.ca, "backend_tls_cert_file": pki.client_cert,
            "backend_tls_key_file": pki.client_key}


@pytest.fixture(scope="module")
def tls_stack(servers, pki, target_dir, good_draft_dir):
    """Target and draft under mutual TLS; a gateway that reaches them with its client certificate and
    serves its own port over TLS."""
    target = servers.target(target_dir, **_server_tls(pki))
    draft = servers.draft(good_draft_dir, **_server_tls(pki))
    gateway = servers.gateway(target, draft, **_server_tls(pki, mutual=False), **_gateway_client_tls(pki))
    return target, draft, gateway


def _stub(security, handle):
    channel = security.channel(f"{HOST}:{handle.port}")
    return channel, generation_service_pb2_grpc.GenerationServiceStub(channel)


def test_a_generation_through_tls_equals_the_plaintext_one(pki, tls_stack, gen_stub):
    _, _, gateway = tls_stack
    channel, stub = _stub(channel_security(ca_file=pki.ca), gateway)
    with channel:
        for prompt in PROMPTS:
            over_tls = generate(stub, generate_request(prompt, max_tokens=N))
            plaintext = generate(gen_stub, generate_request(prompt, max_tokens=N))  # the plaintext stack
            assert over_tls.token_ids == plaintext.token_ids and over_tls.text == plaintext.text
            assert len(over_tls.token_ids) == N and over_tls.last.stats.num_draft_tokens > 0  # the draft took part
        sampled = [generate(s, generate_request(PROMPTS[0], max_tokens=N, temperature=1.0, seed=7)).token_ids
                   for s in (stub, gen_stub)]
        assert sampled[0] == sampled[1]
    assert gateway.backend.check_backends() == ([], [])  # /ready's health checks go over mutual TLS too


def test_the_gateway_port_refuses_plaintext(tls_stack):
    _, _, gateway = tls_stack
    channel, stub = _stub(PLAINTEXT, gateway)
    with channel:
        assert rpc_error(lambda: stub.Generate(generate_request(PROMPTS[0], max_tokens=2), timeout=10)).code().name \
            == "UNAVAILABLE"


def test_backends_refuse_clients_without_a_certificate_from_their_ca(pki, tls_stack):
    target, draft, _ = tls_stack
    for handle in (target, draft):
        with channel_security(pki.ca, pki.client_cert, pki.client_key).channel(f"{HOST}:{handle.port}") as ok:
            assert health_status(ok) == SERVING
        for security in (PLAINTEXT, channel_security(ca_file=pki.ca),
                         channel_security(pki.ca, pki.other_client_cert, pki.other_client_key)):
            with security.channel(f"{HOST}:{handle.port}") as refused:
                assert rpc_error(lambda ch=refused: health_status(ch)).code().name == "UNAVAILABLE"


@pytest.mark.parametrize("client", ["plaintext", "no-client-cert", "other-ca-cert"])
def test_a_gateway_without_the_right_client_certificate_cannot_start(servers, pki, tls_stack, client):
    target, draft, _ = tls_stack
    tls = {"plaintext": {},
           "no-client-cert": {"backend_tls_ca_file": pki.ca},
           "other-ca-cert": {"backend_tls_ca_file": pki.ca, "backend_tls_cert_file": pki.other_client_cert,
                             "backend_tls_key_file": pki.other_client_key}}[client]
    with pytest.raises(BackendUnavailableError, match="did not answer GetInfo: UNAVAILABLE"):
        servers.gateway(target, draft, startup_timeout_seconds=1.0, **tls)


@pytest.mark.parametrize(("settings", "match"), [
    ({"tls_cert_file": "SERVER_CERT"}, "--tls-cert-file needs --tls-key-file"),
    ({"ssl_keyfile": "SERVER_KEY"}, "--ssl-keyfile needs --ssl-certfile"),
    ({"ssl_ca_certs": "CA", "ssl_cert_reqs": 2}, "--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile"),
    ({"ssl_certfile": "SERVER_CERT", "ssl_keyfile": "SERVER_KEY", "ssl_cert_reqs": 2},
     "--ssl-cert-reqs 2 needs --ssl-ca-certs"),
    ({"ssl_certfile": "SERVER_CERT", "ssl_keyfile": "SERVER_KEY", "ssl_ca_certs": "SERVER_KEY", "ssl_cert_reqs": 1},
     "--ssl-ca-certs: .* holds no usable CA certificate"),
    ({"backend_tls_cert_file": "CLIENT_CERT", "backend_tls_key_file": "SERVER_KEY"}, "do not make a certificate"),
    ({"api_key_file": "/nonexistent/keys"}, "--api-key-file: cannot read"),
])
def test_bad_security_settings_stop_the_gateway_before_it_starts(servers, pki, tls_stack, settings, match):
    target, draft, _ = tls_stack
    paths = {"SERVER_CERT": pki.server_cert, "SERVER_KEY": pki.server_key, "CLIENT_CERT": pki.client_cert, "CA": pki.ca}
    with pytest.raises(ConfigError, match=match):
        servers.gateway(target, draft, startup_timeout_seconds=1.0, **{k: paths.get(v, v) for k, v in settings.items()})


# --------------------------------------------------------------------------------------------------
# HTTPS client certificates on the gateway's HTTP port (--ssl-ca-certs, --ssl-cert-reqs)


def _https_client(pki, cert: str | None = None, key: str | None = None) -> httpx.Client:
    context = ssl.create_default_context(cafile=pki.ca)
    if cert is not None:
        context.load_cert_chain(cert, key)
    return httpx.Client(verify=context, timeout=60)


@pytest.fixture(scope="module")
def https_gateways(servers, pki, tls_stack):
    """Gateways over the mutual-TLS backends whose HTTP ports ask for client certificates signed by the
    test CA: required (2) and optional (1)."""
    target, draft, _ = tls_stack
    https = {"ssl_certfile": pki.server_cert, "ssl_keyfile": pki.server_key, "ssl_ca_certs": pki.ca}
    return {reqs: servers.gateway(target, draft, http_port=0, ssl_cert_reqs=reqs, **https, **_gateway_client_tls(pki))
            for reqs in (2, 1)}


def test_https_with_required_client_certificates(pki, https_gateways):
    url = f"https://{HOST}:{https_gateways[2].http_port}"
    with _https_client(pki, pki.client_cert, pki.client_key) as client:
        assert client.get(f"{url}/health").status_code == 200
        body = client.post(f"{url}/v1/completions", json={"model": client.get(f"{url}/v1/models").json()["data"][0]["id"],
                                                          "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
        assert body.status_code == 200 and body.json()["usage"]["completion_tokens"] == 4
    for cert, key in ((None, None), (pki.other_client_cert, pki.other_client_key)):
        with _https_client(pki, cert, key) as refused, pytest.raises(httpx.TransportError):
            refused.get(f"{url}/health")  # the handshake fails: no request reaches the app


def test_https_with_optional_client_certificates(pki, https_gateways):
    url = f"https://{HOST}:{https_gateways[1].http_port}"
    for cert, key in ((None, None), (pki.client_cert, pki.client_key)):
        with _https_client(pki, cert, key) as client:
            assert client.get(f"{url}/health").status_code == 200
    with _https_client(pki, pki.other_client_cert, pki.other_client_key) as refused, pytest.raises(httpx.TransportError):
        refused.get(f"{url}/health")  # a certificate that is sent is checked
