"""The one table of request limits (gateway.limits) holds on both protocols: past a limit, HTTP is a 400
naming the param and gRPC INVALID_ARGUMENT with the same message; an oversized request is HTTP 413 and
gRPC RESOURCE_EXHAUSTED, from the one --max-request-body-bytes."""

from __future__ import annotations

import grpc
import pytest

from gateway.limits import MAX_LOGIT_BIAS, MAX_STOP_LENGTH, MAX_STOP_SEQUENCES, MAX_STOP_TOKEN_IDS
from specdec.v1 import generation_service_pb2_grpc
from tests.conftest import VOCAB_SIZE
from tests.gateway.openai.http_helpers import assert_error_body, httpx
from tests.services_conftest_helpers import PROMPTS, generate, generate_request, rpc_error

BODY_LIMIT = 64 * 1024

# (HTTP body fields, the same on a GenerateRequest, param, words the message must hold)
CASES = [
    ({"stop": [f"s{i}" for i in range(MAX_STOP_SEQUENCES + 1)]},
     {"stop": [f"s{i}" for i in range(MAX_STOP_SEQUENCES + 1)]}, "stop", [str(MAX_STOP_SEQUENCES)]),
    ({"stop": ["x" * (MAX_STOP_LENGTH + 1)]}, {"stop": ["x" * (MAX_STOP_LENGTH + 1)]}, "stop", [str(MAX_STOP_LENGTH)]),
    ({"stop_token_ids": [7] * (MAX_STOP_TOKEN_IDS + 1)}, {"stop_token_ids": [7] * (MAX_STOP_TOKEN_IDS + 1)},
     "stop_token_ids", [str(MAX_STOP_TOKEN_IDS)]),
    ({"logit_bias": {str(t): 1 for t in range(MAX_LOGIT_BIAS + 1)}},
     {"logit_bias": {t: 1.0 for t in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias", [str(MAX_LOGIT_BIAS)]),
    ({"stop_token_ids": [VOCAB_SIZE + 5]}, {"stop_token_ids": [VOCAB_SIZE + 5]}, "stop_token_ids",
     [str(VOCAB_SIZE + 5), "vocabulary"]),
]


@pytest.fixture(scope="module")
def gateway(servers, target_dir):
    gw = servers.gateway(servers.target(target_dir), http_port=0, max_n=2, max_request_body_bytes=BODY_LIMIT)
    channel = grpc.insecure_channel(f"127.0.0.1:{gw.port}")
    client = httpx.Client(base_url=f"http://127.0.0.1:{gw.http_port}", timeout=60)
    yield generation_service_pb2_grpc.GenerationServiceStub(channel), client
    client.close()
    channel.close()


def _grpc_request(fields: dict):
    request = generate_request(PROMPTS[0], max_tokens=2)
    request.stop.extend(fields.get("stop", []))
    request.stop_token_ids.extend(fields.get("stop_token_ids", []))
    if "logit_bias" in fields:
        request.sampling_params.penalties.logit_bias.update(fields["logit_bias"])
    return request


@pytest.mark.parametrize(("body", "fields", "param", "words"), CASES, ids=[f"{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_each_limit_is_a_400_on_http_and_invalid_argument_on_grpc(gateway, body, fields, param, words):
    stub, client = gateway
    response = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2, **body})
    http_message = assert_error_body(response, 400, param=param)["message"]
    err = rpc_error(lambda: stub.Generate(_grpc_request(fields), timeout=60))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert err.details() == http_message  # one check, one message
    for word in words:
        assert word in http_message, (word, http_message)


def test_n_past_max_n_is_a_400(gateway):
    _, client = gateway
    response = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2, "n": 3})
    assert "--max-n" in assert_error_body(response, 400, param="n")["message"]


def test_an_oversized_request_is_refused_on_both_protocols(gateway):
    stub, client = gateway
    big = "word " * (BODY_LIMIT // 5 + 10)
    response = client.post("/v1/completions", json={"prompt": big, "max_tokens": 2})
    assert_error_body(response, 413, code="request_too_large")
    err = rpc_error(lambda: stub.Generate(generate_request(big, max_tokens=2), timeout=60))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err.code(), err.details())
    # at the limits exactly, both still serve
    ok = generate(stub, _grpc_request({"stop": ["x" * MAX_STOP_LENGTH] * MAX_STOP_SEQUENCES}))
    assert len(ok.token_ids) == 2
    response = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2,
                                                    "stop": ["x" * MAX_STOP_LENGTH] * MAX_STOP_SEQUENCES})
    assert response.status_code == 200, response.text
