"""Helpers for the OpenAI-compatible HTTP API tests (tests/gateway/openai/test_http_*.py).

The stacks are the real ``specdec serve`` servers (target + draft + gateway with HTTP) on loopback,
started with the tiny random-weight models of ``tests/conftest.py``; the clients are the official
``openai`` client and plain httpx for the raw HTTP checks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

import pytest
from openai import OpenAI

try:  # the official openai client ships its HTTP library as ``httpx`` (or ``httpx2`` in newer releases)
    import httpx
except ImportError:  # pragma: no cover - depends on the installed openai
    import httpx2 as httpx  # type: ignore[no-redef]

from specdec.entrypoints.serve import ServeConfig, Stack, start_stack
from tests.services_conftest_helpers import sequences_of, wait_until

HOST = "127.0.0.1"
KEY = "sk-specdec-http-test"
K = 3  # num_speculative_tokens of the test stacks
CLIENT_TIMEOUT = 30.0  # every request: a hung connection fails the test instead of hanging it
PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    return"]  # = tests/conftest.PROMPTS


def serve(target_dir, draft_dir, api_key: str | None = KEY, k: int = K, **kw) -> Stack:
    """``specdec serve TARGET --speculative-config {...}`` on loopback, any free ports."""
    spec = json.dumps({"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k})
    return start_stack(ServeConfig(model=str(target_dir), speculative_config=spec, host=HOST, grpc_port=0, port=0,
                                   api_key=api_key, **kw))


def base_url(stack_or_port) -> str:
    port = stack_or_port if isinstance(stack_or_port, int) else stack_or_port.gateway.http_port
    return f"http://{HOST}:{port}"


def openai_client(stack_or_port, api_key: str = KEY, timeout: float = CLIENT_TIMEOUT) -> OpenAI:
    """The official client; no retries, so a 5xx is seen as it is (and fast)."""
    return OpenAI(base_url=f"{base_url(stack_or_port)}/v1", api_key=api_key, timeout=timeout, max_retries=0)


def raw_client(stack_or_port, api_key: str | None = KEY, timeout: float = CLIENT_TIMEOUT) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=base_url(stack_or_port), headers=headers, timeout=timeout)


def assert_error_body(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    """An OpenAI error: the status and exactly ``{"error": {"message", "type", "param", "code"}}``."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if param is not None:
        assert err["param"] == param or str(err["param"]).startswith(param + "."), err
    if code is not None:
        assert err["code"] == code, err
    return err


def sse_events(response) -> list[str]:
    """The ``data:`` payloads of a raw SSE response, in order (``[DONE]`` included)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(line[len("data: "):])
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


def stream_texts(chunks: Iterable[Any], chat: bool = False) -> tuple[dict[int, list[str]], dict[int, str | None], Any]:
    """Per-choice list of text pieces, per-choice finish_reason, and the usage (if a chunk carried it)."""
    pieces: dict[int, list[str]] = {}
    finish: dict[int, str | None] = {}
    usage = None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text = (choice.delta.content if chat else choice.text) or ""
            pieces.setdefault(choice.index, []).append(text)
            if choice.finish_reason is not None:
                assert choice.index not in finish or finish[choice.index] is None, "two finish reasons"
                finish[choice.index] = choice.finish_reason
    return pieces, finish, usage


def spec_decode(usage) -> dict:
    """The ``spec_decode`` extension of a usage object, checked for shape and consistency."""
    extra = usage.model_extra or {}
    assert "spec_decode" in extra, usage
    sd = extra["spec_decode"]
    assert {"num_draft_tokens", "num_accepted_tokens", "acceptance_rate"} <= set(sd), sd
    assert 0 <= sd["num_accepted_tokens"] <= sd["num_draft_tokens"], sd
    rate = sd["num_accepted_tokens"] / sd["num_draft_tokens"] if sd["num_draft_tokens"] else 0.0
    assert sd["acceptance_rate"] == pytest.approx(rate), sd
    return sd


def check_usage(usage, prompt_tokens: int | None = None, completion_tokens: int | None = None) -> dict:
    assert usage.prompt_tokens > 0 and usage.completion_tokens >= 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if prompt_tokens is not None:
        assert usage.prompt_tokens == prompt_tokens
    if completion_tokens is not None:
        assert usage.completion_tokens == completion_tokens
    return spec_decode(usage)


def wait_released(stack: Stack, timeout: float = 10.0) -> None:
    """Both services' KV-cache tables are empty, and the gateway holds nothing for them."""
    for handle in (stack.target, stack.draft):
        wait_until(lambda h=handle: not sequences_of(h), timeout, what=f"{handle.backend.role} caches to be released "
                   f"(held: {list(sequences_of(handle))})")
    gw = stack.gateway.backend
    wait_until(lambda: not gw.target._held and not gw.draft._held, timeout, what="the gateway's clients to forget")


class Recorder:
    """Wraps ``Gateway.new_sequence`` (instance attribute) to keep the SequenceState of each request."""

    def __init__(self, gateway):
        self.gateway = gateway
        self.original = gateway.new_sequence
        self.seqs: list = []

    def __enter__(self) -> "Recorder":
        def record(*args, **kwargs):
            seq = self.original(*args, **kwargs)
            self.seqs.append(seq)
            return seq

        self.gateway.new_sequence = record
        return self

    def __exit__(self, *exc) -> None:
        del self.gateway.new_sequence  # back to the class method


class SlowCalls:
    """Wraps a gateway client's method to sleep before each call and count the calls."""

    def __init__(self, client, method: str, delay: float):
        self.client, self.method, self.delay = client, method, delay
        self.original = getattr(client, method)
        self.calls = 0

    def __enter__(self) -> "SlowCalls":
        def slow(*args, **kwargs):
            self.calls += 1
            time.sleep(self.delay)
            return self.original(*args, **kwargs)

        setattr(self.client, self.method, slow)
        return self

    def __exit__(self, *exc) -> None:
        delattr(self.client, self.method)

