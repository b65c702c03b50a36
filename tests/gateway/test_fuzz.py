"""Fuzzing the gateway's public interfaces: HTTP bodies (malformed JSON, wrong types, out-of-range and
huge values, odd Unicode) and gRPC GenerateRequests. A client's mistake is never a 5xx / INTERNAL, the
service keeps serving, and the next request is still correct."""

from __future__ import annotations


import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.v1 import common_pb2, generation_service_pb2 as gen_pb2, generation_service_pb2_grpc
from tests.gateway.openai.http_helpers import PROMPTS, httpx

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

odd_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40) | st.sampled_from(
    ["", "\u0000", "\ud7ff\ue000", "🍣" * 10, "\u202e\u200b", "a" * 1500])
huge = st.sampled_from([2**31, 2**63, 2**64 + 1, -(2**63) - 1, 10**30, 1e308, -1e308])
junk = st.none() | st.booleans() | huge | st.floats(allow_nan=False) | odd_text | st.lists(st.integers(-5, 60000),
                                                                                           max_size=4) | st.just({})
small_valid = {
    "max_tokens": st.integers(1, 4), "temperature": st.sampled_from([0, 0.5, 1.0]), "top_p": st.sampled_from([0.5, 1]),
    "top_k": st.sampled_from([0, 1, 5]), "n": st.integers(1, 2), "seed": st.integers(0, 2**63 - 1),
    "stop": st.lists(odd_text, max_size=3), "stream": st.booleans(), "ignore_eos": st.booleans(),
    "num_speculative_tokens": st.integers(0, 20), "logprobs": st.none(), "echo": st.booleans(),
}


def _field(name):
    return small_valid[name] | junk


completion_body = st.fixed_dictionaries(
    {"prompt": odd_text | st.lists(st.integers(-10, 70000), max_size=6) | st.lists(odd_text, max_size=2) | junk},
    optional={name: _field(name) for name in small_valid} | {"model": odd_text, "extra_field": junk},
)
chat_body = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                                 "content": odd_text | junk}), max_size=3) | junk},
    optional={name: _field(name) for name in small_valid if name not in ("echo",)} | {"max_completion_tokens": junk},
)


@pytest.fixture(scope="module")
def stack(servers, target_dir, good_draft_dir):
    target, draft = servers.target(target_dir), servers.draft(good_draft_dir)
    handle = servers.gateway(target, draft, http_port=0, num_speculative_tokens=2)
    client = httpx.Client(base_url=f"http://127.0.0.1:{handle.http_port}", timeout=120)
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    yield handle, client, generation_service_pb2_grpc.GenerationServiceStub(channel)
    channel.close()
    client.close()


def _reference(client, target_dir) -> str:
    body = {"model": str(target_dir), "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_http_fuzz_never_5xx_and_keeps_serving(stack, target_dir):
    _, client, _ = stack
    reference = _reference(client, target_dir)
    seen = set()

    @FUZZ
    @given(body=completion_body | chat_body)
    def one(body):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        response = client.post(path, json=body)
        seen.add(response.status_code)
        assert response.status_code < 500, (body, response.status_code, response.text[:500])
        if response.status_code >= 400:
            err = response.json()["error"]
            assert err["message"] and "Traceback" not in err["message"]

    one()
    assert 200 in seen and 400 in seen, seen  # the fuzzer reached both valid and invalid requests

    @FUZZ
    @given(raw=st.binary(max_size=200) | odd_text.map(str.encode) | st.sampled_from(
        [b"{", b"[]", b"null", b'{"prompt": 1e999}', b'{"prompt": "a", "n": 1e400}', b"\xff\xfe", b'"x"']))
    def malformed(raw):
        response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert 400 <= response.status_code < 500, (raw, response.status_code, response.text[:300])

    malformed()
    assert _reference(client, target_dir) == reference


floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
grpc_request = st.builds(
    lambda prompt, ids, temperature, top_p, top_k, seed, max_tokens, stop, stop_ids, k: _grpc_request(
        prompt, ids, temperature, top_p, top_k, seed, max_tokens, stop, stop_ids, k),
    odd_text, st.lists(st.integers(0, 2**32 - 1), max_size=5), floats, floats, st.integers(-(2**31), 2**31 - 1),
    st.none() | st.integers(0, 2**64 - 1), st.none() | st.integers(0, 6), st.lists(odd_text, max_size=3),
    st.lists(st.integers(0, 2**32 - 1), max_size=3), st.none() | st.integers(0, 2**32 - 1))


def _grpc_request(prompt, ids, temperature, top_p, top_k, seed, max_tokens, stop, stop_ids, k):
    sampling = common_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    if seed is not None:
        sampling.seed = seed
    req = gen_pb2.GenerateRequest(prompt=prompt, prompt_token_ids=ids, sampling_params=sampling, stop=stop,
                                  stop_token_ids=stop_ids)
    if max_tokens is not None:
        req.max_tokens = max_tokens
    if k is not None:
        req.num_speculative_tokens = k
    return req


def test_grpc_fuzz_never_internal_and_keeps_serving(stack, target_dir):
    _, client, stub = stack
    reference = _reference(client, target_dir)
    codes = set()

    @FUZZ
    @given(request=grpc_request)
    def one(request):
        try:
            list(stub.Generate(request, timeout=60))
            codes.add("OK")
        except grpc.RpcError as err:
            codes.add(err.code().name)
            assert err.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (request, err.details())
            assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE), (
                request, err.code(), err.details())

    one()
    assert {"OK", "INVALID_ARGUMENT"} <= codes, codes
    assert _reference(client, target_dir) == reference
