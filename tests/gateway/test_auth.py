"""API keys on every public interface of the gateway, and HTTPS, on a real ``specdec serve`` stack whose
gateway-facing security flags are all set: several keys (--api-key twice and --api-key-file), HTTPS on the
HTTP port (--ssl-certfile/--ssl-keyfile) and TLS on the gRPC port (--tls-cert-file/--tls-key-file).

gRPC GenerationService and HTTP /v1/*: no key, a wrong key → UNAUTHENTICATED / 401; each key → OK.
Open without a key: gRPC health and reflection, HTTP /health, /ready, /metrics, /version."""

from __future__ import annotations

import ssl

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai import OpenAI

from specdec.serving.auth import bearer_metadata
from specdec.serving.grpc_errors import ERROR_CLASS_KEY
from specdec.serving.tls import PLAINTEXT, channel_security
from specdec.v1 import common_pb2, generation_service_pb2_grpc
from tests.gateway.openai.http_helpers import CLIENT_TIMEOUT, HOST, assert_error_body, httpx, serve
from tests.metrics_helpers import delta, parse
from tests.services_conftest_helpers import PROMPTS, collect, generate_request, offline_greedy, rpc_error

FLAG_KEYS = ["sk-flag-one", "sk-flag-two"]
FILE_KEY = "sk-from-file"
KEYS = [*FLAG_KEYS, FILE_KEY]
N = 8


@pytest.fixture(scope="module")
def secure_stack(pki, target_dir, good_draft_dir, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text(f"# one key per line\n\n{FILE_KEY}\n")
    stack = serve(target_dir, good_draft_dir, api_key=FLAG_KEYS, api_key_file=str(key_file),
                  ssl_certfile=pki.server_cert, ssl_keyfile=pki.server_key,
                  tls_cert_file=pki.server_cert, tls_key_file=pki.server_key)
    try:
        yield stack
    finally:
        stack.stop(0)


@pytest.fixture(scope="module")
def model(target_dir) -> str:
    return str(target_dir)


@pytest.fixture(scope="module")
def channel(pki, secure_stack):
    with channel_security(ca_file=pki.ca).channel(f"{HOST}:{secure_stack.gateway.port}") as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return generation_service_pb2_grpc.GenerationServiceStub(channel)


def _url(stack) -> str:
    return f"https://{HOST}:{stack.gateway.http_port}"


def _https(pki, key: str | None = None, ca: str | None = "CA") -> httpx.Client:
    verify = ssl.create_default_context(cafile=pki.ca if ca == "CA" else ca)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(verify=verify, headers=headers, timeout=CLIENT_TIMEOUT)


def _openai(pki, stack, key: str) -> OpenAI:
    """The official client given the test CA (how a user trusts a private CA)."""
    return OpenAI(base_url=f"{_url(stack)}/v1", api_key=key, max_retries=0, timeout=CLIENT_TIMEOUT,
                  http_client=_https(pki))


# --------------------------------------------------------------------------------------------------
# gRPC


def _metrics(pki, stack):
    with _https(pki) as raw:
        return parse(raw.get(f"{_url(stack)}/metrics").text)


@pytest.mark.parametrize("metadata", [None, bearer_metadata("sk-wrong"), (("authorization", f"Basic {KEYS[0]}"),)],
                         ids=["no-key", "wrong-key", "not-bearer"])
def test_grpc_without_a_valid_key_is_unauthenticated(pki, secure_stack, stub, model, metadata):
    before = _metrics(pki, secure_stack)
    err = rpc_error(lambda: stub.Generate(generate_request(PROMPTS[0], max_tokens=N), metadata=metadata, timeout=30))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in err.details()
    assert dict(err.trailing_metadata())[ERROR_CLASS_KEY] == "AuthenticationError"
    err = rpc_error(lambda: stub.GetInfo(common_pb2.GetInfoRequest(), metadata=metadata, timeout=30))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    after = _metrics(pki, secure_stack)
    assert delta(after, before, "specdec_request_errors_total", service="gateway", model_name=model, protocol="grpc",
                 code="UNAUTHENTICATED") == 2


@pytest.mark.parametrize("key", KEYS)
def test_grpc_with_each_key_generates(stub, target_llm, key):
    request = generate_request(PROMPTS[0], max_tokens=N)
    out = collect(stub.Generate(request, metadata=bearer_metadata(key), timeout=60))
    assert out.token_ids == offline_greedy(target_llm, PROMPTS[0], N)[1]
    info = stub.GetInfo(common_pb2.GetInfoRequest(), metadata=bearer_metadata(key), timeout=30)
    assert info.target.model_name and info.draft.model_name


def test_grpc_health_and_reflection_need_no_key(channel):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert "specdec.v1.GenerationService" in set(ProtoReflectionDescriptorDatabase(channel).get_services())


def test_grpc_port_speaks_tls_only(secure_stack):
    with PLAINTEXT.channel(f"{HOST}:{secure_stack.gateway.port}") as plain:
        stub = generation_service_pb2_grpc.GenerationServiceStub(plain)
        err = rpc_error(lambda: stub.Generate(generate_request(PROMPTS[0], max_tokens=2),
                                              metadata=bearer_metadata(KEYS[0]), timeout=10))
    assert err.code() == grpc.StatusCode.UNAVAILABLE


# --------------------------------------------------------------------------------------------------
# HTTPS


@pytest.mark.parametrize("key", KEYS)
def test_https_with_each_key_works_with_the_openai_client(pki, secure_stack, model, key):
    with _openai(pki, secure_stack, key) as client:
        assert [m.id for m in client.models.list()] == [model]
        completion = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=N, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == N and completion.choices[0].text


def test_https_without_a_valid_key_is_401(pki, secure_stack, model):
    with _openai(pki, secure_stack, "sk-wrong") as client, pytest.raises(openai.AuthenticationError) as info:
        client.models.list()
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    for key in (None, "sk-wrong", f"{KEYS[0]}x"):
        with _https(pki, key) as raw:
            for response in (raw.get(f"{_url(secure_stack)}/v1/models"),
                             raw.post(f"{_url(secure_stack)}/v1/completions", json={"model": model, "prompt": "x"})):
                assert_error_body(response, 401, code="invalid_api_key")
    with _https(pki) as raw:  # "Basic" is not a bearer token
        response = raw.get(f"{_url(secure_stack)}/v1/models", headers={"Authorization": f"Basic {KEYS[0]}"})
    assert response.status_code == 401


def test_health_ready_metrics_and_version_need_no_key(pki, secure_stack):
    with _https(pki) as raw:
        responses = {path: raw.get(f"{_url(secure_stack)}{path}") for path in ("/health", "/ready", "/metrics", "/version")}
    for path, response in responses.items():
        assert response.status_code == 200, (path, response.text)
    assert responses["/ready"].json()["status"] == "ready"
    assert "specdec_spec_decode_num_drafts_total" in responses["/metrics"].text


def test_https_needs_the_ca_and_refuses_plain_http(pki, secure_stack):
    with _https(pki, KEYS[0], ca=pki.other_ca) as untrusting, pytest.raises(httpx.ConnectError):
        untrusting.get(f"{_url(secure_stack)}/health")
    with OpenAI(base_url=f"{_url(secure_stack)}/v1", api_key=KEYS[0], max_retries=0, timeout=CLIENT_TIMEOUT,
                http_client=_https(pki, ca=pki.other_ca)) as client, pytest.raises(openai.APIConnectionError):
        client.models.list()
    with httpx.Client(timeout=CLIENT_TIMEOUT) as plain, pytest.raises(httpx.HTTPError):
        plain.get(f"http://{HOST}:{secure_stack.gateway.http_port}/health")
