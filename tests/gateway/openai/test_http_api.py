"""The OpenAI-compatible HTTP API of ``specdec serve``, driven by the official ``openai`` client.

One module-scoped stack (target + draft + gateway with an API key) on loopback, tiny models.
"""

from __future__ import annotations

import json
import time

import openai
import pytest

import specdec
from specdec import SamplingParams
from tests.gateway.openai.http_helpers import (
    KEY,
    PROMPTS,
    Recorder,
    SlowCalls,
    assert_error_body,
    check_usage,
    openai_client,
    raw_client,
    sse_events,
    stream_texts,
    wait_released,
)

N = 16  # tokens per generation (short: 2 CPU cores)


@pytest.fixture(scope="module")
def greedy(client, model):
    """Memoised non-streamed greedy completion text of (prompt, max_tokens)."""
    cache: dict = {}

    def get(prompt: str, max_tokens: int = N):
        if (prompt, max_tokens) not in cache:
            cache[prompt, max_tokens] = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                                  temperature=0)
        return cache[prompt, max_tokens]

    return get


# -- models / health ---------------------------------------------------------------------------------


def test_models_list_returns_the_served_model(client, model):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [model]
    assert models.data[0].object == "model"
    assert models.data[0].owned_by


def test_health_ready_version(http_stack):
    with raw_client(http_stack, api_key=None) as c:  # not under /v1: no key needed
        health = c.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        ready = c.get("/ready")
        assert ready.status_code == 200, ready.text
        assert ready.json()["status"] == "ready"
        version = c.get("/version")
        assert version.status_code == 200 and version.json() == {"version": specdec.__version__}


# -- completions ------------------------------------------------------------------------------------


def test_completion_plain(greedy, model):
    resp = greedy(PROMPTS[0])
    assert resp.object == "text_completion" and resp.model == model and resp.id
    assert len(resp.choices) == 1
    choice = resp.choices[0]
    assert choice.index == 0 and isinstance(choice.text, str) and choice.text
    assert choice.finish_reason in ("length", "stop")
    check_usage(resp.usage)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_equals_offline_target_only(http_stack, client, model, target_llm, tokenizer, prompt):
    """Lossless: speculative greedy over HTTP == the target alone (specdec.LLM), text AND token ids."""
    ref = target_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=N))[0].outputs[0]
    with Recorder(http_stack.gateway.backend) as rec:
        resp = client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0)
    assert resp.choices[0].text == ref.text
    assert resp.choices[0].finish_reason == ref.finish_reason
    assert [s.output_token_ids for s in rec.seqs] == [list(ref.token_ids)]
    sd = check_usage(resp.usage, prompt_tokens=len(tokenizer(prompt).input_ids), completion_tokens=len(ref.token_ids))
    assert sd["num_draft_tokens"] > 0, "the request was not decoded speculatively"


def test_max_tokens_gives_finish_reason_length(client, model):
    resp = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    check_usage(resp.usage, completion_tokens=8)
    # and without ignore_eos the tiny model does not stop early either: the budget ends it
    plain = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=8, temperature=0)
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 8


def test_prompt_as_list_of_strings(client, model, greedy, tokenizer):
    resp = client.completions.create(model=model, prompt=PROMPTS, max_tokens=N, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [greedy(p).choices[0].text for p in PROMPTS]
    check_usage(resp.usage, prompt_tokens=sum(len(tokenizer(p).input_ids) for p in PROMPTS),
                completion_tokens=sum(greedy(p).usage.completion_tokens for p in PROMPTS))


def test_prompt_as_token_ids(client, model, greedy, tokenizer):
    ids = tokenizer(PROMPTS[0]).input_ids
    resp = client.completions.create(model=model, prompt=ids, max_tokens=N, temperature=0)
    assert resp.choices[0].text == greedy(PROMPTS[0]).choices[0].text
    check_usage(resp.usage, prompt_tokens=len(ids))
    # a batch of token-id prompts
    both = client.completions.create(model=model, prompt=[tokenizer(p).input_ids for p in PROMPTS], max_tokens=N,
                                     temperature=0)
    assert [c.text for c in both.choices] == [greedy(p).choices[0].text for p in PROMPTS]


def test_n_choices_seeded_reproducible_with_distinct_seeds(client, model):
    kw = dict(model=model, prompt=PROMPTS[0], max_tokens=N, temperature=0.8, seed=7)
    resp = client.completions.create(n=3, **kw)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    texts = [c.text for c in resp.choices]
    assert all(texts)
    again = client.completions.create(n=3, **kw)
    assert [c.text for c in again.choices] == texts, "seeded n>1 sampling is not reproducible"
    # choice i is sampled with seed + i: distinct, reproducible samples
    singles = [client.completions.create(**{**kw, "seed": 7 + i}).choices[0].text for i in range(3)]
    assert singles == texts
    assert len(set(texts)) > 1, f"n=3 choices all identical at temperature 0.8: {texts}"
    # usage counts the prompt once, the completions of every choice
    check_usage(resp.usage, prompt_tokens=again.usage.prompt_tokens,
                completion_tokens=again.usage.completion_tokens)
    assert resp.usage.completion_tokens == sum(
        client.completions.create(**{**kw, "seed": 7 + i}).usage.completion_tokens for i in range(3))


def test_seed_reproducibility_at_temperature(client, model):
    kw = dict(model=model, prompt=PROMPTS[1], max_tokens=N, temperature=0.8)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    assert a == b
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert len(others | {a}) > 1, "every seed gave the same sample at temperature 0.8"


def test_echo_prepends_the_prompt(client, model, greedy, tokenizer):
    resp = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=N, temperature=0, echo=True)
    text = resp.choices[0].text
    assert text.startswith(PROMPTS[0])
    assert text == PROMPTS[0] + greedy(PROMPTS[0]).choices[0].text
    # echo of a token-id prompt echoes its text
    ids = tokenizer(PROMPTS[1]).input_ids
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=N, temperature=0, echo=True)
    assert by_ids.choices[0].text == PROMPTS[1] + greedy(PROMPTS[1]).choices[0].text


def _stop_string(full: str) -> str:
    """A stop string that occurs in ``full`` after some text (so the cut is visible)."""
    for start in range(3, len(full) - 3):
        cand = full[start:start + 3]
        if cand.strip() and full.find(cand) >= 3:
            return cand
    pytest.fail(f"no usable stop string in {full!r}")


def test_stop_string_ends_the_text_before_it(client, model, greedy):
    full = greedy(PROMPTS[0], 24).choices[0].text
    stop = _stop_string(full)
    expected = full[:full.find(stop)]
    resp = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=stop)
    choice = resp.choices[0]
    assert choice.text == expected
    assert stop not in choice.text
    assert choice.finish_reason == "stop"
    assert resp.usage.completion_tokens < 24
    # a list of stop strings: the earliest one wins
    as_list = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                        stop=["\x00never\x00", stop])
    assert as_list.choices[0].text == expected and as_list.choices[0].finish_reason == "stop"
    # streamed: no chunk leaks any part of the stop string, and the pieces add up to the same text
    pieces, finish, _ = stream_texts(client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=24,
                                                               temperature=0, stop=stop, stream=True))
    assert "".join(pieces[0]) == expected and finish == {0: "stop"}


def test_user_is_accepted(client, model, greedy):
    resp = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=N, temperature=0, user="user-1234")
    assert resp.choices[0].text == greedy(PROMPTS[0]).choices[0].text


def test_completion_without_model_field_uses_the_served_model(raw, model, greedy):
    r = raw.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": N, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    assert r.json()["choices"][0]["text"] == greedy(PROMPTS[0]).choices[0].text


# -- chat completions ---------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fox."}]


def test_chat_completion_uses_the_chat_template(http_stack, client, model, target_llm, tokenizer):
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    ids = list(ids)
    ref = target_llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=N))[0].outputs[0]
    with Recorder(http_stack.gateway.backend) as rec:
        resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=N, temperature=0)
    assert [s.prompt_token_ids for s in rec.seqs] == [ids]
    assert resp.object == "chat.completion" and resp.model == model
    msg = resp.choices[0].message
    assert msg.role == "assistant"
    assert msg.content == ref.text
    assert resp.choices[0].finish_reason == ref.finish_reason
    assert [s.output_token_ids for s in rec.seqs] == [list(ref.token_ids)]
    check_usage(resp.usage, prompt_tokens=len(ids), completion_tokens=len(ref.token_ids))


def test_chat_max_completion_tokens(client, model):
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    check_usage(resp.usage, completion_tokens=5)


def test_chat_content_parts_and_multi_turn(client, model):
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "Name "},
                                                          {"type": "text", "text": "a fox."}]}]
    by_parts = client.chat.completions.create(model=model, messages=parts, max_tokens=8, temperature=0)
    assert by_parts.choices[0].message.content == plain.choices[0].message.content
    turns = MESSAGES + [{"role": "assistant", "content": plain.choices[0].message.content},
                        {"role": "user", "content": "Another."}]
    more = client.chat.completions.create(model=model, messages=turns, max_tokens=8, temperature=0)
    assert more.usage.prompt_tokens > plain.usage.prompt_tokens
    assert more.choices[0].message.content


# -- streaming -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
def test_stream_completion_equals_non_streamed(client, model, greedy, prompt):
    full = greedy(prompt).choices[0]
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0, stream=True))
    assert all(c.object == "text_completion" and c.model == model for c in chunks)
    assert len({c.id for c in chunks}) == 1
    pieces, finish, usage = stream_texts(chunks)
    assert set(pieces) == {0}
    assert "".join(pieces[0]) == full.text  # only new text in each chunk: no repeats, nothing lost
    assert sum(1 for p in pieces[0] if p) > 1, "the text came in one chunk: not streamed"
    assert finish == {0: full.finish_reason}
    assert usage is None  # no usage chunk unless asked for


def test_stream_chunks_carry_only_new_text(raw, model, greedy):
    """Raw SSE: every event is a JSON chunk whose text is a delta (concatenation == full text)."""
    full = greedy(PROMPTS[0], 24).choices[0].text
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "stream": True}
    with raw.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert "[DONE]" not in events[:-1]
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts) == full
    so_far = ""
    for t in texts:
        if t and so_far:
            assert not t.startswith(so_far), f"chunk {t!r} repeats the earlier text {so_far!r}"
        so_far += t
        assert full.startswith(so_far)


def test_stream_include_usage_gives_a_final_usage_chunk(client, model, greedy):
    full = greedy(PROMPTS[1])
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=N, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    check_usage(last.usage, prompt_tokens=full.usage.prompt_tokens, completion_tokens=full.usage.completion_tokens)
    pieces, _, _ = stream_texts(chunks)
    assert "".join(pieces[0]) == full.choices[0].text


def test_stream_echo_and_n(client, model, greedy):
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=N, temperature=0, echo=True,
                                            n=2, stream=True, stream_options={"include_usage": True}))
    pieces, finish, usage = stream_texts(chunks)
    expected = PROMPTS[0] + greedy(PROMPTS[0]).choices[0].text
    assert {i: "".join(p) for i, p in pieces.items()} == {0: expected, 1: expected}
    assert set(finish) == {0, 1}
    check_usage(usage, prompt_tokens=greedy(PROMPTS[0]).usage.prompt_tokens,
                completion_tokens=2 * greedy(PROMPTS[0]).usage.completion_tokens)


def test_stream_seeded_sampling_equals_non_streamed(client, model):
    kw = dict(model=model, prompt=PROMPTS[0], max_tokens=N, temperature=0.8, seed=99)
    full = client.completions.create(**kw).choices[0].text
    pieces, _, _ = stream_texts(client.completions.create(stream=True, **kw))
    assert "".join(pieces[0]) == full


def test_chat_stream_equals_non_streamed(client, model, raw):
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=N, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=N, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces, finish, usage = stream_texts(chunks, chat=True)
    assert "".join(pieces[0]) == full.choices[0].message.content
    assert sum(1 for p in pieces[0] if p) > 1, "the text came in one chunk: not streamed"
    assert finish == {0: full.choices[0].finish_reason}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    check_usage(usage, prompt_tokens=full.usage.prompt_tokens, completion_tokens=full.usage.completion_tokens)
    # raw SSE ends with [DONE] on the chat endpoint too
    body = {"model": model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "stream": True}
    with raw.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]" and len(events) > 2


def test_concurrent_requests_match_sequential(client, model, greedy):
    from concurrent.futures import ThreadPoolExecutor

    jobs = [PROMPTS[i % 2] for i in range(4)]

    def one(prompt):
        return client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0).choices[0].text

    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(one, jobs))
    assert texts == [greedy(p).choices[0].text for p in jobs]


# -- abandoned streams -------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["completions", "chat", "chat-role-chunk-only"])
def test_abandoned_stream_releases_both_services(http_stack, client, model, endpoint):
    """Break out of the stream and close it: the generation stops and both caches are freed."""
    wait_released(http_stack)  # nothing left over from earlier tests
    gateway = http_stack.gateway.backend
    # each round takes >= 50 ms; 200 tokens need >= 50 rounds (k=3: <= 4 tokens a round), > 2.5 s,
    # if nobody stopped them
    with SlowCalls(gateway.target, "verify", 0.05) as slow:
        kw = dict(model=model, max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True})
        if endpoint.startswith("chat"):
            stream = client.chat.completions.create(messages=MESSAGES, **kw)
        else:
            stream = client.completions.create(prompt=PROMPTS[1], **kw)
        for chunk in stream:
            if endpoint == "chat-role-chunk-only":
                assert chunk.choices[0].delta.role == "assistant"
                break
            text = chunk.choices[0].delta.content if endpoint == "chat" else chunk.choices[0].text
            if text:
                break
        if endpoint != "chat-role-chunk-only":
            assert slow.calls > 0 and len(http_stack.draft.backend.runner.sequences) == 1
        stream.close()
        if endpoint == "chat-role-chunk-only":
            time.sleep(0.5)  # let a generation nobody stopped get going
        wait_released(http_stack, timeout=10)
        calls = slow.calls
    assert calls < 40, f"the gateway ran {calls} rounds for an abandoned stream"
    # the server still answers
    after = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert after.usage.completion_tokens == 4


def test_completed_requests_leave_no_sequences(http_stack, client, model):
    client.completions.create(model=model, prompt=PROMPTS, max_tokens=8, temperature=0, n=2)
    list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0, stream=True))
    wait_released(http_stack)


# -- API key -----------------------------------------------------------------------------------------


def test_wrong_api_key_is_401(http_stack, model):
    with openai_client(http_stack, api_key="sk-wrong") as bad, pytest.raises(openai.AuthenticationError) as info:
        bad.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4)
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"
    with openai_client(http_stack, api_key="sk-wrong") as bad, pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with openai_client(http_stack, api_key="sk-wrong") as bad, pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)


def test_missing_api_key_is_401(http_stack, model):
    with raw_client(http_stack, api_key=None) as c:
        r = c.post("/v1/completions", json={"model": model, "prompt": PROMPTS[0], "max_tokens": 4})
        assert_error_body(r, 401, code="invalid_api_key")
        assert_error_body(c.get("/v1/models"), 401)
        # the key must be a Bearer token, exactly
        r = c.get("/v1/models", headers={"Authorization": KEY})
        assert_error_body(r, 401)
        r = c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_abandoned_non_streamed_request_releases_both_services(http_stack, model, path):
    """A client that gives up on a non-streamed request (its timeout) cancels the generation: it stops
    within a few rounds and both caches are freed."""
    from tests.gateway.openai.http_helpers import httpx

    wait_released(http_stack)
    gateway = http_stack.gateway.backend
    body = {"model": model, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "n": 2}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": PROMPTS[1]})
    with SlowCalls(gateway.target, "verify", 0.05) as slow:
        with raw_client(http_stack, timeout=1.0) as c, pytest.raises(httpx.TimeoutException):
            c.post(path, json=body)
        wait_released(http_stack, timeout=10)
        calls = slow.calls
    assert 0 < calls < 80, f"the gateway ran {calls} rounds for 2 abandoned sequences"
    with raw_client(http_stack) as c:
        assert c.post("/v1/completions", json={"model": model, "prompt": PROMPTS[0], "max_tokens": 2}).status_code == 200
