"""Requests that cannot be served are refused up front, and a full server sheds load with 429s:
n past --max-n, best_of, absurd stop lists, oversized bodies; over capacity, some requests get 429 at
once (with Retry-After) while the rest complete correctly, and nothing is a 5xx."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.gateway.openai.http_helpers import PROMPTS, assert_error_body, httpx

N = 24


@pytest.fixture(scope="module")
def small_gateway(servers, target_dir, good_draft_dir):
    target, draft = servers.target(target_dir), servers.draft(good_draft_dir)
    handle = servers.gateway(target, draft, http_port=0, max_concurrent_requests=2, max_queue_len=1,
                             max_n=4, max_request_body_bytes=4096)
    client = httpx.Client(base_url=f"http://127.0.0.1:{handle.http_port}", timeout=60)
    yield handle, client
    client.close()


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"n": 5}, "n", ["n=5", "4", "--max-n"]),
    ({"n": 2, "best_of": 3}, "best_of", ["best_of"]),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop", ["16", "17"]),
    ({"stop": "x" * 2000}, "stop", ["1024"]),
    ({"max_tokens": 100_000}, "max_tokens", ["max_tokens=100000", "max_model_len"]),
])
def test_requests_that_cannot_be_served_are_400s_naming_the_limit(small_gateway, target_dir, body, param, words):
    _, client = small_gateway
    response = client.post("/v1/completions", json={"model": str(target_dir), "prompt": PROMPTS[0], **body})
    err = assert_error_body(response, 400, param=param)
    for word in words:
        assert word in err["message"], (word, err["message"])


def test_an_oversized_body_is_refused_before_it_is_read(small_gateway, target_dir):
    _, client = small_gateway
    response = client.post("/v1/completions", content=json.dumps({"model": str(target_dir), "prompt": "x " * 5000}),
                           headers={"content-type": "application/json"})
    err = assert_error_body(response, 413, code="request_too_large")
    assert "4096" in err["message"]
    ok = client.post("/v1/completions", json={"model": str(target_dir), "prompt": PROMPTS[0], "max_tokens": 2})
    assert ok.status_code == 200  # and the server keeps serving


def test_over_capacity_some_requests_get_429_at_once_the_rest_complete(small_gateway, target_dir):
    handle, client = small_gateway
    body = {"model": str(target_dir), "prompt": PROMPTS[1], "max_tokens": N, "temperature": 0, "ignore_eos": True}
    reference = client.post("/v1/completions", json=body).json()["choices"][0]["text"]

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: client.post("/v1/completions", json=body), range(8)))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 429}, statuses  # never a 5xx
    assert statuses.count(429) >= 1 and statuses.count(200) >= 3, statuses  # 2 running + 1 queued at least
    for r in responses:
        if r.status_code == 200:
            assert r.json()["choices"][0]["text"] == reference
        else:
            assert r.headers["retry-after"] == "1"
            assert "--max-queue-len" in assert_error_body(r, 429, code="resource_exhausted")["message"]
    admission = handle.backend.admission
    assert (admission.running, admission.waiting) == (0, 0)  # every slot given back
