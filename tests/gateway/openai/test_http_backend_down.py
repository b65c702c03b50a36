"""A backend that is down: /ready and every generation answer 503 quickly, never 500, never hang.

The stack is built by hand (target + draft services, gateway with HTTP) so the gateway's clients
give up retrying an UNAVAILABLE backend after 1 s instead of the default 60 s.
"""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.gateway.openai.http_helpers import (
    KEY,
    PROMPTS,
    assert_error_body,
    openai_client,
    raw_client,
    sse_events,
)
from tests.services_conftest_helpers import Stack, wait_released

FAST = 10.0  # seconds: backend_timeout (1 s) + margin on a loaded 2-core machine


@pytest.fixture(scope="module")
def down_stack(servers, target_dir, good_draft_dir):
    """Only for test_backend_down_is_503 (which stops its target)."""
    target = servers.target(target_dir)
    draft = servers.draft(good_draft_dir)
    gateway = servers.gateway(target, draft, http_port=0, api_key=KEY, backend_timeout_seconds=1.0,
                              num_speculative_tokens=3)
    return Stack(target, draft, gateway)


def _fails_fast(call, error=openai.APIStatusError):
    """``call()`` raises ``error`` within FAST seconds; return the exception."""
    start = time.monotonic()
    with pytest.raises(error) as info:
        call()
    took = time.monotonic() - start
    assert took < FAST, f"the request took {took:.1f} s to fail"
    return info.value


def test_backend_down_is_503(servers, down_stack, target_dir):
    model = str(target_dir)
    client = openai_client(down_stack.gateway.http_port, timeout=30)
    raw = raw_client(down_stack.gateway.http_port, timeout=30)
    try:
        assert raw.get("/ready").status_code == 200
        ok = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4, temperature=0)
        assert ok.usage.completion_tokens == 4

        servers.stop(down_stack.target, 0)

        ready = raw.get("/ready")
        err = assert_error_body(ready, 503, code="backend_unavailable")
        assert "target" in err["message"]
        assert raw.get("/health").status_code == 200  # the gateway itself is alive

        calls = {
            "completions": lambda: client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4),
            "chat": lambda: client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                           max_tokens=4),
            "responses": lambda: client.responses.create(model=model, input="hi", max_output_tokens=4),
        }
        for name, call in calls.items():
            exc = _fails_fast(call)
            assert exc.status_code == 503, (name, exc)
            assert isinstance(exc, openai.InternalServerError)
            assert_error_body(exc.response, 503, code="backend_unavailable")

        # streamed requests fail too, as fast (a 503, or an error event inside the started stream)
        exc = _fails_fast(lambda: list(client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=4,
                                                                 stream=True)), openai.APIError)
        if isinstance(exc, openai.APIStatusError):
            assert exc.status_code == 503
        else:  # an error event inside the stream
            assert exc.code == "backend_unavailable", exc.body

        # raw SSE: the stream ends (error event, then [DONE]) instead of hanging
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 4, "stream": True}
        start = time.monotonic()
        with raw.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code == 200:
                events = sse_events(r)
                assert events[-1] == "[DONE]"
                errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
                assert len(errors) == 1 and errors[0]["code"] == "backend_unavailable", events
            else:
                r.read()
                assert_error_body(r, 503, code="backend_unavailable")
        assert time.monotonic() - start < FAST

        # a Responses stream ends with an error event, then response.failed (or is a 503 before it starts)
        body = {"model": model, "input": "hi", "max_output_tokens": 4, "stream": True}
        start = time.monotonic()
        with raw.stream("POST", "/v1/responses", json=body) as r:
            if r.status_code == 200:
                kinds = [json.loads(line[len("data: "):])["type"] for line in r.iter_lines()
                         if line.startswith("data: ")]
                assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-2:] == [
                    "error", "response.failed"], kinds
            else:
                r.read()
                assert_error_body(r, 503, code="backend_unavailable")
        assert time.monotonic() - start < FAST

        # the draft, still up, does not keep the failed requests' sequences
        wait_released(down_stack.draft, timeout=10)
    finally:
        client.close()
        raw.close()


def test_draft_down_is_degraded_not_unready(servers, target_dir, good_draft_dir):
    """With the draft fallback (the default) a draft that is down leaves the gateway ready, degraded:
    requests are served by the target alone. Without it, the gateway is not ready."""
    target, draft = servers.target(target_dir), servers.draft(good_draft_dir)
    with_fallback = servers.gateway(target, draft, http_port=0, num_speculative_tokens=3)
    without = servers.gateway(target, draft, http_port=0, num_speculative_tokens=3, draft_fallback=False)
    servers.stop(draft, 0)
    with raw_client(with_fallback.http_port, api_key=None) as raw:
        ready = raw.get("/ready")
        assert ready.status_code == 200 and ready.json()["status"] == "degraded", ready.text
        assert "draft" in ready.json()["degraded"][0]
        done = raw.post("/v1/completions", json={"model": str(target_dir), "prompt": PROMPTS[0], "max_tokens": 4})
        assert done.status_code == 200 and done.json()["usage"]["spec_decode"]["num_draft_tokens"] == 0
    with raw_client(without.http_port, api_key=None) as raw:
        assert_error_body(raw.get("/ready"), 503, code="backend_unavailable")
