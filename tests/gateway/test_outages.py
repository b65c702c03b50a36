"""Outages of separate service processes, killed with real signals, behind an in-process gateway.

- The draft dies mid-stream (SIGKILL): the stream completes, identical to the target alone; a new
  request while it is down is served without drafts at once; once it is back, rounds draft again.
- The target dies mid-stream: the stream ends with a clean UNAVAILABLE within the backend timeout,
  new requests are refused at once while it is down, and service resumes by itself when it returns.
"""

from __future__ import annotations

import time

import grpc
import pytest

from gateway.config import GatewayConfig
from specdec.v1 import generation_service_pb2_grpc
from tests.service_processes import service_pair
from tests.services_conftest_helpers import (
    PROMPTS,
    collect,
    generate,
    generate_request,
    hooked,
    offline_greedy,
    rpc_error,
    run_in_thread,
    wait_until,
)

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def processes(target_dir, good_draft_dir, tmp_path_factory):
    yield from service_pair(target_dir, good_draft_dir, tmp_path_factory.mktemp("outage-logs"))


def _gateway(servers, target, draft, **kw):
    from gateway.server import create_server

    config = GatewayConfig(target_addr=target.address, draft_addr=draft.address, host="127.0.0.1", port=0,
                           num_speculative_tokens=3, startup_timeout_seconds=60.0, **kw)
    handle = servers.add(create_server(config))
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    return handle.backend, generation_service_pb2_grpc.GenerationServiceStub(channel), channel


@pytest.mark.heavy
def test_draft_killed_mid_stream_falls_back_to_the_target_alone(processes, servers, target_llm):
    target, draft = processes
    gw, stub, channel = _gateway(servers, target, draft, draft_breaker_failures=2, draft_breaker_reset_seconds=0.5)
    reference = offline_greedy(target_llm, PROMPTS[0], MAX_TOKENS)
    try:
        with hooked(gw.target, "verify") as hook:
            hook.pause_at(3)
            thread, box = run_in_thread(lambda: collect(stub.Generate(
                generate_request(PROMPTS[0], max_tokens=MAX_TOKENS), timeout=120)))
            hook.wait_paused(60)
            draft.kill()  # SIGKILL: the draft and its caches are gone
            hook.resume()
            thread.join(120)
        assert not thread.is_alive() and "error" not in box, box.get("error")
        out = box["result"]
        assert (out.text, out.token_ids) == reference
        assert out.last.stats.num_accepted_tokens > 0  # it did draft before the kill

        # while the draft is down: served at once, by the target alone
        began = time.monotonic()
        alone = generate(stub, generate_request(PROMPTS[1], max_tokens=12))
        assert time.monotonic() - began < 20
        assert alone.token_ids == offline_greedy(target_llm, PROMPTS[1], 12)[1]
        assert alone.last.stats.num_draft_tokens == 0
        assert gw.draft.breaker.state == "open"

        draft.start()  # back (a new process: empty caches)
        def drafting_again() -> bool:
            return generate(stub, generate_request(PROMPTS[1], max_tokens=12)).last.stats.num_draft_tokens > 0
        wait_until(drafting_again, timeout=30, interval=0.3, what="speculation to resume")
        again = generate(stub, generate_request(PROMPTS[0], max_tokens=MAX_TOKENS))
        assert (again.text, again.token_ids) == reference and again.last.stats.num_draft_tokens > 0
        assert gw.draft.breaker.state == "closed"
    finally:
        channel.close()
        if draft.proc.poll() is not None:
            draft.start()


@pytest.mark.heavy
def test_target_killed_mid_stream_is_a_clean_error_then_service_resumes(processes, servers, target_llm):
    target, draft = processes
    gw, stub, channel = _gateway(servers, target, draft, backend_timeout_seconds=3.0)
    try:
        with hooked(gw.target, "verify") as hook:
            hook.pause_at(3)
            thread, box = run_in_thread(lambda: collect(stub.Generate(
                generate_request(PROMPTS[0], max_tokens=MAX_TOKENS), timeout=120)))
            hook.wait_paused(60)
            target.kill()
            began = time.monotonic()
            hook.resume()
            thread.join(60)
        assert not thread.is_alive()
        err = box.get("error")
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.UNAVAILABLE, box
        assert "target" in err.details()
        assert time.monotonic() - began < 10, "the in-flight request outlived the backend timeout"

        # while it is down: refused at once (no retry window)
        began = time.monotonic()
        err = rpc_error(lambda: generate(stub, generate_request(PROMPTS[1], max_tokens=8), timeout=30))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - began < 1.0

        target.start()
        wait_until(lambda: not gw.target_health.down, timeout=30, what="the gateway to see the target back")
        out = generate(stub, generate_request(PROMPTS[1], max_tokens=12))
        assert out.token_ids == offline_greedy(target_llm, PROMPTS[1], 12)[1]
    finally:
        channel.close()
        if target.proc.poll() is not None:
            target.start()
