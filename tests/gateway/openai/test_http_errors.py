"""HTTP API errors: the client's typed exceptions with OpenAI error bodies, never a 500 for a user
mistake, never a hung connection (every client has a timeout)."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.openai.http_helpers import (
    PROMPTS,
    assert_error_body,
    openai_client,
    wait_released,
)

MESSAGES = [{"role": "user", "content": "Hello"}]
VOCAB_SIZE = 49152


@pytest.fixture(scope="module")
def client(http_stack):
    c = openai_client(http_stack, timeout=20)
    yield c
    c.close()


def _id(fields: dict) -> str:
    flat = {**{k: v for k, v in fields.items() if k != "extra_body"}, **fields.get("extra_body", {})}
    return ",".join(f"{k}={v!r}"[:50] for k, v in flat.items())


def bad_request(call, param: str) -> openai.BadRequestError:
    """``call()`` fails with a 400 whose OpenAI error body names ``param``."""
    with pytest.raises(openai.BadRequestError) as info:
        call()
    exc = info.value
    assert exc.status_code == 400
    assert_error_body(exc.response, 400, param=param)
    assert exc.type == "invalid_request_error"
    return exc


# -- bad parameters -----------------------------------------------------------------------------------

COMPLETION_BAD = [
    # (request fields, the parameter the error must name)
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": 3}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": -1}, "n"),
    ({"n": "two"}, "n"),
    ({"seed": -1}, "seed"),
    ({"seed": "abc"}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"echo": "maybe"}, "echo"),
    ({"stream_options": "usage"}, "stream_options"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),
    ({"extra_body": {"min_tokens": 8}}, "min_tokens"),
    ({"extra_body": {"min_tokens": -1}}, "min_tokens"),
    ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids"),
    ({"extra_body": {"top_k": -2}}, "top_k"),
    ({"extra_body": {"num_speculative_tokens": -1}}, "num_speculative_tokens"),
    ({"extra_body": {"num_speculative_tokens": 1000}}, "num_speculative_tokens"),
    ({"extra_body": {"ignore_eos": "sometimes"}}, "ignore_eos"),
]


@pytest.mark.parametrize(("fields", "param"), COMPLETION_BAD, ids=[_id(f) for f, _ in COMPLETION_BAD])
def test_completion_bad_parameter_is_400_naming_it(client, model, fields, param):
    bad_request(lambda: client.completions.create(**{"model": model, "prompt": PROMPTS[0], "max_tokens": 4,
                                                     **fields}), param)


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"extra_body": {"num_speculative_tokens": 1000}}, "num_speculative_tokens"),
], ids=["max_tokens", "temperature", "num_speculative_tokens"])
def test_streamed_bad_parameter_is_400_before_the_stream(client, model, fields, param):
    """A bad parameter on a streamed request is a 400 response, not an error event inside a 200 stream."""
    bad_request(lambda: list(client.completions.create(**{"model": model, "prompt": PROMPTS[0], "max_tokens": 4,
                                                          "stream": True, **fields})), param)


def test_frequency_penalty_error_names_frequency_penalty(client, model):
    """Only frequency_penalty is out of range, and the error names it (not presence_penalty)."""
    bad_request(lambda: client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4,
                                                  frequency_penalty=2.5), "frequency_penalty")


def test_top_k_beyond_int32_is_400_not_500(client, model):
    """top_k has no upper bound; the gRPC SamplingParams.top_k is int32, so building the proto raises
    ValueError inside the worker thread: an unhandled 500 with a plain-text body."""
    bad_request(lambda: client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4,
                                                  extra_body={"top_k": 2**31}), "top_k")


CHAT_BAD = [
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": "yes please"}, "logprobs"),
]


@pytest.mark.parametrize(("fields", "param"), CHAT_BAD, ids=[_id(f) for f, _ in CHAT_BAD])
def test_chat_bad_parameter_is_400_naming_it(client, model, fields, param):
    bad_request(lambda: client.chat.completions.create(**{"model": model, "messages": MESSAGES, "max_tokens": 4,
                                                          **fields}), param)


# -- bad prompts -----------------------------------------------------------------------------------------

BAD_PROMPTS = [
    ("", "empty string"),
    ([], "empty list"),
    ([""], "list with an empty string"),
    ([[]], "empty token list"),
    ([[1, 2], []], "one empty token list in a batch"),
    (None, "null"),
    (123, "a number"),
    ([1, "a"], "mixed ids and text"),
    ({"text": "hi"}, "an object"),
    ([[1.5, 2]], "fractional token ids"),
]


@pytest.mark.parametrize(("prompt", "what"), BAD_PROMPTS, ids=[w for _, w in BAD_PROMPTS])
def test_bad_prompt_is_400(client, model, prompt, what):
    bad_request(lambda: client.completions.create(model=model, prompt=prompt, max_tokens=4), "prompt")


def test_token_id_outside_the_vocabulary_is_400(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=[1, VOCAB_SIZE], max_tokens=4)
    err = assert_error_body(info.value.response, 400)
    assert str(VOCAB_SIZE) in err["message"] and err["type"] == "invalid_request_error"


def test_token_id_outside_the_vocabulary_names_the_prompt_parameter(client, model):
    """The HTTP request has no ``prompt_token_ids`` field: ``param`` should name ``prompt``."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=[1, VOCAB_SIZE], max_tokens=4)
    assert info.value.param == "prompt"


def test_negative_token_id_is_400_not_500(client, model):
    """Gateway.new_sequence only rejects ids >= vocab; a negative id reaches the uint32 proto field
    (ValueError in the worker thread): an unhandled 500 with a plain-text body."""
    bad_request(lambda: client.completions.create(model=model, prompt=[1, -1, 2], max_tokens=4), "prompt")


def test_missing_required_fields_are_400(raw, model):
    assert_error_body(raw.post("/v1/completions", json={"model": model, "max_tokens": 4}), 400, param="prompt")
    assert_error_body(raw.post("/v1/chat/completions", json={"model": model}), 400, param="messages")


def test_malformed_json_body_is_400(raw):
    r = raw.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": ', headers={"content-type": "application/json"})
    assert_error_body(r, 400)
    r = raw.post("/v1/completions", json=["not", "an", "object"])
    assert_error_body(r, 400)
    r = raw.post("/v1/chat/completions", content=b"\xff\xfe", headers={"content-type": "application/json"})
    assert_error_body(r, 400)


# -- prompt over max_model_len (256 for the tiny models) -------------------------------------------------


def test_prompt_over_max_model_len_is_400(client, model, http_stack):
    max_len = http_stack.gateway.backend.max_model_len
    assert max_len == 256
    models = client.models.list()
    assert models.data[0].model_extra.get("max_model_len") == max_len
    # a prompt that fills the context leaves no room to generate
    exc = bad_request(lambda: client.completions.create(model=model, prompt=[5] * max_len, max_tokens=4), "prompt")
    assert str(max_len) in exc.message
    bad_request(lambda: client.completions.create(model=model, prompt="fox " * 400, max_tokens=4), "prompt")
    bad_request(lambda: client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "fox " * 400}], max_tokens=4), "prompt")
    # streamed: the 400 comes before the stream
    bad_request(lambda: list(client.completions.create(model=model, prompt=[5] * (max_len + 10), max_tokens=4,
                                                       stream=True)), "prompt")
    # one over-long prompt in a batch fails the whole request, before anything is generated
    bad_request(lambda: client.completions.create(model=model, prompt=[PROMPTS[0], "fox " * 400], max_tokens=4),
                "prompt")
    wait_released(http_stack)


def test_prompt_just_under_max_model_len_generates_to_the_limit(client, model, http_stack):
    """Without max_tokens, a prompt one token short of max_model_len gets the one token left; asking for
    more than the context leaves is refused up front (400 naming max_tokens and the limit), as in vLLM."""
    max_len = http_stack.gateway.backend.max_model_len
    resp = client.completions.create(model=model, prompt=[5] * (max_len - 1), temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == max_len - 1 and resp.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=[5] * (max_len - 1), max_tokens=50, temperature=0)
    err = assert_error_body(info.value.response, 400, param="max_tokens")
    assert "max_tokens=50" in err["message"] and f"max_model_len is {max_len}" in err["message"]
    assert "at most 1" in err["message"]


# -- unknown model / route / method -------------------------------------------------------------------------


def test_unknown_model_is_404(client):
    for call in (lambda: client.completions.create(model="no-such-model", prompt=PROMPTS[0], max_tokens=4),
                 lambda: client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4),
                 lambda: list(client.completions.create(model="no-such-model", prompt=PROMPTS[0], max_tokens=4,
                                                        stream=True))):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.status_code == 404
        err = assert_error_body(info.value.response, 404, param="model", code="model_not_found")
        assert "no-such-model" in err["message"]


def test_unknown_route_is_404_with_an_openai_body(raw):
    assert_error_body(raw.get("/v1/nope"), 404, code="not_found")
    assert_error_body(raw.post("/v1/nope", json={}), 404)
    assert_error_body(raw.get("/nope"), 404)


def test_wrong_method_is_405_with_an_openai_body(raw):
    assert_error_body(raw.get("/v1/completions"), 405)
    assert_error_body(raw.delete("/v1/models"), 405)


def test_errors_leave_the_server_healthy(client, model, http_stack):
    wait_released(http_stack)
    resp = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert resp.usage.completion_tokens == 4
    wait_released(http_stack)


def test_chat_template_refusing_the_messages_is_400_naming_messages(client, model, http_stack):
    """Templates check the conversation themselves (Gemma's: roles must alternate) and raise; that
    is the caller's mistake: 400 naming `messages`, never a 500, and the server keeps serving."""
    tokenizer = http_stack.gateway.backend.tokenizer
    saved = tokenizer.chat_template
    tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    try:
        exc = bad_request(lambda: client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4),
                          "messages")
        assert "roles must alternate" in exc.message
    finally:
        tokenizer.chat_template = saved
    assert client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2).choices[0].message.content is not None
