"""Admission by the KV cache budget: the gateway reads each backend's kv_cache_capacity_tokens at start-up. A
request that could never fit the smallest pool is a 400 / INVALID_ARGUMENT naming the numbers and the flag; one
without max_tokens stops there; one that fits the pool but not beside the running sequences waits in the admission
queue (counted as waiting) and runs when they finish."""

from __future__ import annotations

import grpc
import pytest

from specdec.serving import metrics as M
from specdec.v1 import common_pb2, generation_service_pb2 as gen_pb2, generation_service_pb2_grpc
from tests.gateway.openai.http_helpers import assert_error_body, httpx
from tests.metrics_helpers import parse, total
from tests.services_conftest_helpers import (
    collect,
    generate,
    generate_request,
    hooked,
    rpc_error,
    run_in_thread,
    wait_released,
    wait_until,
)

# The tiny target (3 layers, 2 KV heads of 16 floats) holds a token in 768 bytes: this pool is about 128 tokens.
KV_CACHE_MEMORY = 128 * 768


@pytest.fixture(scope="module")
def small_pool(servers, target_dir, good_draft_dir):
    target = servers.target(target_dir, kv_cache_memory=KV_CACHE_MEMORY)
    draft = servers.draft(good_draft_dir)
    gw = servers.gateway(target, draft, http_port=0)
    channel = grpc.insecure_channel(f"127.0.0.1:{gw.port}")
    yield target, draft, gw, generation_service_pb2_grpc.GenerationServiceStub(channel)
    channel.close()


def _capacity(small_pool) -> int:
    target, _, gw, _ = small_pool
    capacity = gw.backend.kv_capacity
    assert capacity == target.backend.info()["kv_cache_capacity_tokens"]
    assert 64 <= capacity <= 128 and gw.backend.kv_capacity_service == "target"
    return capacity


def _ids(n: int, offset: int = 0) -> list[int]:
    return [1000 + (offset + 7 * i) % 3000 for i in range(n)]


def test_the_gateway_reads_the_pools_capacity(small_pool):
    _, draft, gw, stub = small_pool
    capacity = _capacity(small_pool)
    info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    assert info.target.kv_cache_capacity_tokens == capacity and info.target.block_size == 16
    assert info.draft.kv_cache_capacity_tokens == draft.backend.info()["kv_cache_capacity_tokens"] > capacity


def test_a_request_that_could_never_fit_is_invalid_naming_the_capacity_and_the_flag(small_pool, target_dir):
    _, _, gw, stub = small_pool
    capacity = _capacity(small_pool)
    prompt = _ids(10)
    err = rpc_error(lambda: stub.Generate(generate_request(prompt_token_ids=prompt, max_tokens=capacity), timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    for word in (str(capacity), str(10 + capacity), f"max_tokens={capacity}", "--kv-cache-memory", "target"):
        assert word in err.details(), (word, err.details())
    err = rpc_error(lambda: stub.Generate(generate_request(prompt_token_ids=_ids(capacity), max_tokens=None),
                                          timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "--kv-cache-memory" in err.details()
    with httpx.Client(base_url=f"http://127.0.0.1:{gw.http_port}", timeout=60) as client:
        response = client.post("/v1/completions", json={"model": str(target_dir), "prompt": prompt,
                                                         "max_tokens": capacity})
    message = assert_error_body(response, 400, param="max_tokens")["message"]
    assert str(capacity) in message and "--kv-cache-memory" in message


def test_a_request_that_fills_the_pool_exactly_runs_and_one_without_max_tokens_stops_there(small_pool):
    _, _, _, stub = small_pool
    capacity = _capacity(small_pool)
    out = generate(stub, generate_request(prompt_token_ids=_ids(10), max_tokens=capacity - 10))
    assert len(out.token_ids) == capacity - 10
    unbounded = generate(stub, generate_request(prompt_token_ids=_ids(10), max_tokens=None))
    assert unbounded.token_ids == out.token_ids  # greedy: the same tokens, stopped by the pool's size
    assert unbounded.last.finish_reason == gen_pb2.FINISH_REASON_LENGTH


def test_a_request_waits_for_room_in_the_pool_then_completes(small_pool):
    target, draft, gw, stub = small_pool
    capacity = _capacity(small_pool)
    gateway = gw.backend
    first = generate_request(prompt_token_ids=_ids(capacity // 2), max_tokens=8, k=2)
    # fits the pool alone (prompt + max_tokens <= capacity), not beside the first one's prompt
    second = generate_request(prompt_token_ids=_ids(capacity // 2 + 2, offset=5), max_tokens=4, k=2)
    references = [generate(stub, first).token_ids, generate(stub, second).token_ids]
    wait_released(target, draft)

    def waiting() -> float:
        return total(parse(M.exposition().decode()), "specdec_num_requests_waiting", service="gateway",
                     model_name=gateway.served_model_name)

    waiting_before = waiting()
    with hooked(gateway.target, "verify") as hook:
        hook.pause_at(2)  # the first request runs, parked before its second round
        t1, box1 = run_in_thread(lambda: collect(stub.Generate(first, timeout=60)))
        hook.wait_paused()
        assert gateway.admission.running == 1 and gateway.admission.kv_tokens() > capacity // 2
        t2, box2 = run_in_thread(lambda: collect(stub.Generate(second, timeout=60)))
        wait_until(lambda: gateway.admission.waiting == 1, what="the second request to wait")
        assert waiting() == waiting_before + 1  # counted in the waiting gauge
        assert gateway.admission.running == 1 and hook.calls == 2  # it has not started: no call of its own yet
        hook.resume()
        t1.join(60)
        t2.join(60)
    assert "error" not in box1 and "error" not in box2, (box1.get("error"), box2.get("error"))
    assert [box1["result"].token_ids, box2["result"].token_ids] == references
    assert gateway.admission.waiting == 0 and gateway.admission.running == 0 and waiting() == waiting_before


@pytest.mark.heavy
def test_sequences_that_outgrow_the_pool_together_are_preempted_and_resent_with_the_same_output(small_pool):
    """Both prompts fit beside each other, so both start; as they generate they outgrow the pool, which preempts
    the younger: the gateway resends it whole after a short wait, and both outputs are what each gives alone."""
    target, draft, gw, stub = small_pool
    capacity = _capacity(small_pool)
    prompt_len, max_tokens = capacity // 3, capacity // 2
    assert 2 * prompt_len <= capacity < 2 * (prompt_len + max_tokens) and prompt_len + max_tokens <= capacity
    requests = [generate_request(prompt_token_ids=_ids(prompt_len, offset=i * 11), max_tokens=max_tokens, k=2)
                for i in range(2)]
    references = [generate(stub, r).token_ids for r in requests]
    wait_released(target, draft)
    preemptions = target.backend.runner.kv_stats().preemptions
    runs = [run_in_thread(lambda r=r: collect(stub.Generate(r, timeout=120))) for r in requests]
    for thread, _ in runs:
        thread.join(120)
    assert [box.get("error") for _, box in runs] == [None, None]
    assert [box["result"].token_ids for _, box in runs] == references
    assert target.backend.runner.kv_stats().preemptions > preemptions
