"""``specdec serve`` without an API key, and with a short max_model_len (64)."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.openai.http_helpers import (
    PROMPTS,
    assert_error_body,
    openai_client,
    raw_client,
    serve,
    wait_released,
)

MAX_LEN = 64


@pytest.fixture(scope="module")
def open_stack(target_dir, good_draft_dir):
    stack = serve(target_dir, good_draft_dir, api_key=None, max_model_len=MAX_LEN)
    try:
        yield stack
    finally:
        stack.stop(0)


def test_without_api_key_requests_without_a_key_work(open_stack, target_dir):
    model = str(target_dir)
    with raw_client(open_stack, api_key=None) as raw:
        r = raw.get("/v1/models")
        assert r.status_code == 200 and r.json()["data"][0]["id"] == model
        r = raw.post("/v1/completions", json={"model": model, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    # any key the client sends is fine too
    with openai_client(open_stack, api_key="anything") as client:
        resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                              temperature=0)
        assert resp.choices[0].message.content is not None


def test_max_model_len_limits_prompt_and_output(open_stack, target_dir):
    model = str(target_dir)
    with openai_client(open_stack, api_key="unused") as client:
        assert client.models.list().data[0].model_extra["max_model_len"] == MAX_LEN
        for prompt in ([5] * MAX_LEN, [5] * 100, "fox " * 80):
            with pytest.raises(openai.BadRequestError) as info:
                client.completions.create(model=model, prompt=prompt, max_tokens=4)
            err = assert_error_body(info.value.response, 400, param="prompt")
            assert str(MAX_LEN) in err["message"]
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "fox " * 80}],
                                           max_tokens=4)
        # prompt + max_tokens beyond the limit: refused up front, naming max_tokens and the limit
        ids = [5] * 50
        for max_tokens in (1000, MAX_LEN - 50 + 1):
            with pytest.raises(openai.BadRequestError) as info:
                client.completions.create(model=model, prompt=ids, max_tokens=max_tokens, temperature=0)
            err = assert_error_body(info.value.response, 400, param="max_tokens")
            assert str(MAX_LEN) in err["message"] and f"at most {MAX_LEN - 50}" in err["message"]
        # exactly what the context leaves: generation stops at max_model_len
        resp = client.completions.create(model=model, prompt=ids, max_tokens=MAX_LEN - 50, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert resp.choices[0].finish_reason == "length"
        assert resp.usage.prompt_tokens == 50 and resp.usage.completion_tokens == MAX_LEN - 50
        # chat without max_tokens: up to the limit
        resp = client.completions.create(model=model, prompt=[5] * (MAX_LEN - 1), temperature=0,
                                         extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == 1 and resp.choices[0].finish_reason == "length"
    wait_released(open_stack)
