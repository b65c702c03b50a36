"""Restarting the draft, then the target service in the middle of a stream loses no correctness.

The gateway's clients retry UNAVAILABLE while a service is down and, when the restarted service
answers NOT_FOUND (it lost the sequence's cache), resend the whole history. The stream is paced
deterministically: a hook parks the gateway's thread before a given Verify call while the test
restarts a service on the same port.
"""

from __future__ import annotations

import logging

import grpc
import pytest

from specdec.v1 import generation_service_pb2_grpc
from tests.services_conftest_helpers import (
    PROMPTS,
    collect,
    draft_config,
    generate,
    generate_request,
    hooked,
    offline_greedy,
    rpc_error,
    run_in_thread,
    sequences_of,
    target_config,
    wait_released,
    wait_until,
)

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def restartable(servers, target_dir, good_draft_dir):
    """Own target + draft + gateway (the tests here restart/stop services)."""
    target = servers.target(target_dir)
    draft = servers.draft(good_draft_dir)
    gw = servers.gateway(target, draft, backend_timeout_seconds=20.0)
    channel = grpc.insecure_channel(f"127.0.0.1:{gw.port}")
    yield {"target": target, "draft": draft, "gateway": gw,
           "stub": generation_service_pb2_grpc.GenerationServiceStub(channel)}
    channel.close()


def _restart_target(servers, handle, target_dir):
    from target_service.server import create_server

    return servers.restart(handle, lambda port: create_server(target_config(target_dir, port=port)))


def _restart_draft(servers, handle, draft_dir):
    from draft_service.server import create_server

    return servers.restart(handle, lambda port: create_server(draft_config(draft_dir, port=port)))


def test_restart_draft_then_target_mid_stream(restartable, servers, target_dir, good_draft_dir, target_llm, caplog):
    caplog.set_level(logging.INFO, logger="gateway.clients")
    st = restartable
    gateway = st["gateway"].backend
    request = generate_request(PROMPTS[0], max_tokens=MAX_TOKENS, k=2)
    reference = offline_greedy(target_llm, PROMPTS[0], MAX_TOKENS)

    with hooked(gateway.target, "verify") as hook:
        hook.pause_at(3, 6)
        thread, box = run_in_thread(lambda: collect(st["stub"].Generate(request, timeout=120)))

        # round 3: the gateway holds drafted tokens and is about to verify them -> restart the draft
        hook.wait_paused()
        old_draft = st["draft"]
        assert len(sequences_of(old_draft)) == 1 and len(sequences_of(st["target"])) == 1
        st["draft"] = new_draft = _restart_draft(servers, old_draft, good_draft_dir)
        assert not sequences_of(new_draft)
        hook.resume()

        # round 6: restart the target, which holds the whole committed history so far
        hook.wait_paused()
        assert sequences_of(new_draft), "the restarted draft did not get the history resent"
        old_target = st["target"]
        st["target"] = new_target = _restart_target(servers, old_target, target_dir)
        hook.resume()
        thread.join(60)

    assert not thread.is_alive() and "error" not in box, box.get("error")
    out = box["result"]
    assert (out.text, out.token_ids) == reference
    assert hook.calls == out.last.stats.num_target_passes > 6, "the restarts were not in the middle"
    assert out.last.stats.num_accepted_tokens > 0
    # each replacement answered NOT_FOUND to the incremental request and got the history resent
    assert "draft lost sequence" in caplog.text and "target lost sequence" in caplog.text
    # the replacements served the rest of the stream (beyond their warm-up batch)
    assert len(new_draft.backend.batch_sizes) > 1 and len(new_target.backend.batch_sizes) > 1
    wait_released(new_target, new_draft)

    # and the gateway keeps serving new streams on the restarted pair
    again = generate(st["stub"], generate_request(PROMPTS[1], max_tokens=16, k=3))
    assert (again.text, again.token_ids) == offline_greedy(target_llm, PROMPTS[1], 16)


def test_service_down_longer_than_retry_window_is_unavailable(restartable, servers, tokenizer):
    """Without the draft fallback (--no-draft-fallback), a draft that stays down: UNAVAILABLE with a
    message naming the draft, then recovery. (With the fallback, the default, see test_draft_outage.py.)"""
    st = restartable
    gw = servers.gateway(st["target"], st["draft"], backend_timeout_seconds=0.5, draft_fallback=False)
    channel = grpc.insecure_channel(f"127.0.0.1:{gw.port}")
    stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
    try:
        port = st["draft"].port
        servers.stop(st["draft"], 0)
        err = rpc_error(lambda: stub.Generate(generate_request(PROMPTS[0], max_tokens=8), timeout=30))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "draft" in err.details()
        wait_released(st["target"])  # the target's half of the failed stream was released

        from draft_service.server import create_server

        st["draft"] = servers.add(create_server(draft_config(st["draft"].backend.config.model, port=port)))

        def served():
            # gRPC's channel reconnects with a backoff that grew while the draft was down, and this gateway retries
            # for 0.5 s only: until the channel is back, a request is the same clean UNAVAILABLE naming the draft
            try:
                return generate(stub, generate_request(PROMPTS[0], max_tokens=8))
            except grpc.RpcError as again:
                assert again.code() == grpc.StatusCode.UNAVAILABLE and "draft" in again.details(), again
                return None

        out = wait_until(served, timeout=30, interval=0.2, what="the gateway to serve on the restarted draft")
        assert len(out.token_ids) == 8
    finally:
        channel.close()
