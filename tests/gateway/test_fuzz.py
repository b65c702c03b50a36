"""Fuzzing the gateway's public interfaces: HTTP bodies (malformed JSON, wrong types, out-of-range and
huge values, odd Unicode: lone UTF-16 surrogates, NUL bytes; deep nesting) and gRPC GenerateRequests (and
bytes that are not one). A client's mistake is never a 5xx / INTERNAL, a body that is not valid Unicode is
a 400 naming the field, the service keeps serving, and the next request is still correct."""

from __future__ import annotations

import json

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from specdec.v1 import common_pb2, generation_service_pb2 as gen_pb2, generation_service_pb2_grpc
from tests.gateway.openai.http_helpers import PROMPTS, httpx

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

odd_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40) | st.sampled_from(
    ["", "\u0000", "\ud7ff\ue000", "🍣" * 10, "\u202e\u200b", "a" * 1500])
# lone UTF-16 surrogates: valid JSON escapes ("\\ud800"), not valid Unicode
surrogate_text = st.builds(lambda a, c, b: a + chr(c) + b, odd_text, st.sampled_from([0xD800, 0xDBFF, 0xDC00, 0xDFFF]),
                           odd_text)
text = odd_text | surrogate_text
huge = st.sampled_from([2**31, 2**63, 2**64 + 1, -(2**63) - 1, 10**30, 1e308, -1e308])
junk = st.none() | st.booleans() | huge | st.floats(allow_nan=False) | odd_text | st.lists(st.integers(-5, 60000),
                                                                                           max_size=4) | st.just({})
small_valid = {
    "max_tokens": st.integers(1, 4), "temperature": st.sampled_from([0, 0.5, 1.0]), "top_p": st.sampled_from([0.5, 1]),
    "top_k": st.sampled_from([0, 1, 5]), "n": st.integers(1, 2), "seed": st.integers(0, 2**63 - 1),
    "stop": st.lists(text, max_size=3), "stream": st.booleans(), "ignore_eos": st.booleans(),
    "num_speculative_tokens": st.integers(0, 20), "logprobs": st.none(), "echo": st.booleans(),
    "user": text, "logit_bias": st.dictionaries(st.integers(0, 60000).map(str) | text, st.integers(-100, 100),
                                                max_size=3),
}


def _field(name):
    return small_valid[name] | junk


completion_body = st.fixed_dictionaries(
    {"prompt": text | st.lists(st.integers(-10, 70000), max_size=6) | st.lists(text, max_size=2) | junk},
    optional={name: _field(name) for name in small_valid} | {"model": odd_text, "extra_field": junk},
)
chat_body = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                                 "content": text | junk}), max_size=3) | junk},
    optional={name: _field(name) for name in small_valid if name not in ("echo",)} | {"max_completion_tokens": junk},
)

item = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "input_image"]) | junk,
    "role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]) | junk,
    "content": text | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text",
                                                                                 "input_image"]) | junk,
                                                       "text": text | junk}), max_size=2) | junk,
    "call_id": text | junk, "name": text | junk, "arguments": text | junk, "output": text | junk})
tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search_preview", "file_search"]) | junk},
                             optional={"name": text | junk, "parameters": st.just({"type": "object"}) | junk})
responses_body = st.fixed_dictionaries(
    {"input": text | st.lists(item, max_size=3) | junk},
    optional={"instructions": text | junk, "max_output_tokens": st.integers(1, 4) | junk,
              "temperature": st.sampled_from([0, 1.0]) | junk, "tools": st.lists(tool, max_size=2) | junk,
              "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"}]) | junk,
              "parallel_tool_calls": st.booleans() | junk, "stream": st.booleans(), "store": st.booleans() | junk,
              "previous_response_id": text | junk, "include": st.lists(text, max_size=2) | junk,
              "text": st.fixed_dictionaries({"format": st.fixed_dictionaries({"type": st.sampled_from(
                  ["text", "json_object", "json_schema"]) | junk}, optional={"schema": st.just({"type": "object"})
                                                                              | junk})}) | junk,
              "truncation": st.sampled_from(["auto", "disabled"]) | junk, "reasoning": junk, "metadata": junk,
              "seed": st.integers(0, 9) | junk})


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


def _post(client, path: str, body) -> object:
    """POST ``body`` as JSON text with \\u escapes (as a client in any language may send a lone surrogate)."""
    return client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def _unencodable(value) -> bool:
    """Whether a string (or object key) anywhere in ``value`` is not valid Unicode."""
    if isinstance(value, str):
        return any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, dict):
        return any(_unencodable(k) or _unencodable(v) for k, v in value.items())
    return isinstance(value, list) and any(_unencodable(v) for v in value)


@pytest.mark.heavy
def test_http_fuzz_never_5xx_and_keeps_serving(stack, target_dir):
    _, client, _ = stack
    reference = _reference(client, target_dir)
    seen, messages = set(), []

    @FUZZ
    @given(body=completion_body | chat_body)
    # valid bodies, tried whatever the draws (which bodies the fuzzer draws varies between processes)
    @example(body={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    @example(body={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stop": ["\u0000"]})
    def one(body):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        response = _post(client, path, body)
        if _unencodable(body):  # whatever else is wrong with it, nothing of it is read
            assert response.status_code == 400, (body, response.status_code, response.text[:500])
            assert "surrogate" in response.json()["error"]["message"]
        seen.add(response.status_code)
        if response.status_code == 400 and len(messages) < 5:
            messages.append(response.json()["error"]["message"][:200])
        assert response.status_code < 500, (body, response.status_code, response.text[:500])
        if response.status_code >= 400:
            err = response.json()["error"]
            assert err["message"] and "Traceback" not in err["message"]

    one()
    assert 200 in seen and 400 in seen, (seen, messages)  # the fuzzer reached both valid and invalid requests

    @FUZZ
    @given(raw=st.binary(max_size=200) | odd_text.map(str.encode) | st.sampled_from(
        [b"{", b"[]", b"null", b'{"prompt": 1e999}', b'{"prompt": "a", "n": 1e400}', b"\xff\xfe", b'"x"',
         b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}",
         b'{"prompt": "\\ud800"}', b'{"prompt": "a", "stop": "\\udfff"}']))
    def malformed(raw):
        response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert 400 <= response.status_code < 500, (raw, response.status_code, response.text[:300])

    malformed()
    assert _reference(client, target_dir) == reference


@pytest.mark.heavy
def test_responses_fuzz_never_5xx_and_keeps_serving(stack, target_dir):
    """/v1/responses: items, tools, formats and ids of every shape; streamed bodies are read to their end."""
    _, client, _ = stack
    reference = _reference(client, target_dir)
    seen = set()

    @FUZZ
    @given(body=responses_body)
    @example(body={"input": "Hello", "max_output_tokens": 2, "temperature": 0})
    @example(body={"input": [{"role": "user", "content": "hi"}], "max_output_tokens": 2, "stream": True})
    def one(body):
        response = _post(client, "/v1/responses", body)
        seen.add(response.status_code)
        assert response.status_code < 500, (body, response.status_code, response.text[:500])
        if response.status_code >= 400:
            err = response.json()["error"]
            assert err["message"] and "Traceback" not in err["message"]
        elif body.get("stream") is True:
            assert "event: response.completed" in response.text or "event: response.incomplete" in response.text, \
                response.text[-500:]

    one()
    assert 200 in seen and 400 in seen, seen
    assert _reference(client, target_dir) == reference


def _raw(field_and_value: str) -> bytes:
    return ('{"model": null, "max_tokens": 2, "temperature": 0, ' + field_and_value + "}").encode()


CHAT = '"messages": [{"role": "user", "content": "hi"}]'
# (path, raw JSON body, the param a 400 names; None: served)
STRUCTURED = [
    ("/v1/completions", _raw('"prompt": "\\ud800abc"'), "prompt"),
    ("/v1/completions", _raw('"prompt": "abc\\udc00"'), "prompt"),
    ("/v1/completions", _raw('"prompt": ["ok", "x\\udbff"]'), "prompt.1"),
    ("/v1/completions", _raw('"prompt": "ok", "stop": ["fine", "\\ud800"]'), "stop.1"),
    ("/v1/completions", _raw('"prompt": "ok", "stop": "\\udfff"'), "stop"),
    ("/v1/completions", _raw('"prompt": "ok", "logit_bias": {"\\ud800": 5}'), "logit_bias"),
    ("/v1/completions", _raw('"prompt": "ok", "user": "\\ud800"'), "user"),
    ("/v1/chat/completions", _raw('"messages": [{"role": "user", "content": "\\ud800"}]'), "messages.0.content"),
    ("/v1/chat/completions", _raw('"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]'),
     "messages.0.content.0.text"),
    ("/v1/chat/completions", _raw(CHAT + ', "stop": ["\\ud800"]'), "stop.0"),
    ("/v1/chat/completions", _raw(CHAT + ', "user": "\\udfff"'), "user"),
    ("/v1/chat/completions", _raw(CHAT + ', "logit_bias": {"\\udfff": 1}'), "logit_bias"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ("/v1/responses", _raw('"input": "\\ud800"'), "input"),
    ("/v1/responses", _raw('"input": [{"role": "user", "content": [{"type": "input_text", "text": "\\udc00"}]}]'),
     "input.0.content.0.text"),
    ("/v1/responses", _raw('"input": "ok", "instructions": "\\udfff"'), "instructions"),
    ("/v1/completions", _raw('"prompt": "a\\u0000b", "stop": ["\\u0000"]'), None),  # NUL is valid text
    ("/v1/chat/completions", _raw('"messages": [{"role": "user", "content": "\\u0000"}], "stop": "\\u0000"'), None),
    ("/v1/completions", _raw('"prompt": "ok", "temperature": 1e308'), "temperature"),
    ("/v1/completions", _raw('"prompt": "ok", "n": ' + "1" + "0" * 400), "n"),
    ("/v1/completions", _raw('"prompt": "ok", "seed": ' + "1" + "0" * 400), "seed"),
    ("/v1/completions", _raw('"prompt": "ok", "logit_bias": {"1' + "0" * 400 + '": 1}'), "logit_bias"),
    ("/v1/completions", _raw('"prompt": "ok", "stop_token_ids": [1' + "0" * 400 + "]"), "stop_token_ids"),
    ("/v1/chat/completions", _raw(CHAT + ', "max_completion_tokens": 1' + "0" * 400),
     "max_completion_tokens"),
    ("/v1/completions", _raw('"prompt": {"text": "ok"}'), "prompt"),
    ("/v1/chat/completions", _raw('"messages": "hi"'), "messages"),
    ("/v1/chat/completions", _raw('"messages": [{"role": "user", "content": 5}]'), "messages.0.content"),
]


@pytest.mark.parametrize(("path", "raw", "param"), STRUCTURED, ids=[f"{i}-{c[2]}" for i, c in enumerate(STRUCTURED)])
def test_structured_bad_input_is_a_400_naming_the_field(stack, path, raw, param):
    _, client, _ = stack
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    if param is None:
        assert response.status_code == 200, response.text[:500]
        return
    assert response.status_code == 400, (raw[:200], response.status_code, response.text[:500])
    err = response.json()["error"]
    assert err["param"] == param, (raw[:200], err)
    assert err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize("raw", [b"[" * 10_000 + b"]" * 10_000,
                                 b'{"prompt": ' + b"[" * 10_000 + b"1" + b"]" * 10_000 + b"}",
                                 b'{"messages": ' + b'{"a": ' * 5_000 + b"1" + b"}" * 5_000 + b"}"],
                         ids=["arrays", "prompt-arrays", "objects"])
def test_deep_nesting_is_a_400_saying_so(stack, raw):
    _, client, _ = stack
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400, (path, response.status_code, response.text[:300])
        assert "nested too deeply" in response.json()["error"]["message"], response.text[:300]


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


@pytest.mark.heavy
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


def _with_bytes(request: gen_pb2.GenerateRequest, field: int, value: bytes) -> bytes:
    """The request's bytes plus one more length-delimited ``field`` holding ``value`` as is (protobuf's
    Python API refuses to build a string that is not UTF-8; another client's may not)."""
    return request.SerializeToString() + bytes([field << 3 | 2, len(value)]) + value


LONE_SURROGATE = b"\xed\xa0\x80"  # U+D800 as (invalid) UTF-8


@pytest.mark.parametrize(("raw", "param"), [
    (_with_bytes(gen_pb2.GenerateRequest(max_tokens=2), 2, b"abc" + LONE_SURROGATE), "prompt"),
    (_with_bytes(gen_pb2.GenerateRequest(prompt="abc", max_tokens=2), 6, LONE_SURROGATE), "stop"),
    (_with_bytes(gen_pb2.GenerateRequest(prompt="abc", max_tokens=2), 1, b"\xff\xfe"), "request_id"),
    (b"\xff\xff\xff\xff", None),  # not a GenerateRequest at all
])
def test_grpc_bytes_protobuf_cannot_parse_are_invalid_argument(stack, raw, param):
    handle, _, stub = stack
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    generate_raw = channel.unary_stream("/specdec.v1.GenerationService/Generate",
                                        response_deserializer=gen_pb2.GenerateResponse.FromString)
    try:
        with pytest.raises(grpc.RpcError) as info:
            list(generate_raw(raw, timeout=60))
    finally:
        channel.close()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (info.value.code(), info.value.details())
    assert (param or "not a valid specdec.v1.GenerateRequest") in info.value.details()
    # NUL bytes are valid text: served
    ok = list(stub.Generate(gen_pb2.GenerateRequest(prompt="a\x00b", stop=["\x00"], max_tokens=2), timeout=60))
    assert sum(len(r.token_ids) for r in ok) >= 1


@pytest.mark.heavy
def test_grpc_random_bytes_never_internal_and_keeps_serving(stack, target_dir):
    handle, client, stub = stack
    request = gen_pb2.GenerateRequest(prompt=PROMPTS[0], max_tokens=8,
                                      sampling_params=common_pb2.SamplingParams(temperature=0))
    reference = "".join(r.text for r in stub.Generate(request, timeout=60))
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    generate_raw = channel.unary_stream("/specdec.v1.GenerationService/Generate",
                                        response_deserializer=gen_pb2.GenerateResponse.FromString)

    @FUZZ
    @given(raw=st.binary(max_size=64), cut=st.integers(0, 40), junk=st.binary(min_size=1, max_size=8))
    def one(raw, cut, junk):
        for data in (raw, request.SerializeToString()[:cut] + junk):
            try:
                list(generate_raw(data, timeout=60))
            except grpc.RpcError as err:
                assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), (
                    data, err.code(), err.details())

    try:
        one()
    finally:
        channel.close()
    assert "".join(r.text for r in stub.Generate(request, timeout=60)) == reference
    assert _reference(client, target_dir)  # and HTTP still serves
