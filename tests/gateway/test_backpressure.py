"""A full target (max_sequences) is RESOURCE_EXHAUSTED at the gateway; the draft's half is released."""

from __future__ import annotations

import grpc
import pytest

from specdec.v1 import generation_service_pb2_grpc
from tests.services_conftest_helpers import (
    PROMPTS,
    collect,
    generate,
    generate_request,
    hooked,
    offline_greedy,
    rpc_error,
    run_in_thread,
    sequences_of,
    wait_released,
    wait_until,
)


@pytest.fixture(scope="module")
def small(servers, target_dir, good_draft_dir):
    target = servers.target(target_dir, max_sequences=1)
    draft = servers.draft(good_draft_dir)
    gw = servers.gateway(target, draft)
    channel = grpc.insecure_channel(f"127.0.0.1:{gw.port}")
    yield target, draft, gw, generation_service_pb2_grpc.GenerationServiceStub(channel)
    channel.close()


def test_full_target_is_resource_exhausted_and_the_stream_in_flight_completes(small, target_llm):
    target, draft, gw, stub = small
    first_req = generate_request(PROMPTS[0], max_tokens=12, k=2)
    with hooked(gw.backend.target, "verify") as hook:
        hook.pause_at(2)  # the first stream holds the target's only slot, parked before round 2
        thread, box = run_in_thread(lambda: collect(stub.Generate(first_req, timeout=60)))
        hook.wait_paused()
        assert len(sequences_of(target)) == 1
        err = rpc_error(lambda: stub.Generate(generate_request(PROMPTS[1], max_tokens=4), timeout=30))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_sequences" in err.details() and "target" in err.details()
        # the refused stream's draft cache is released (the release is not waited for by the gateway,
        # so poll); only the first stream's remains
        wait_until(lambda: len(sequences_of(draft)) == 1, what="the refused stream's draft release")
        hook.resume()
        thread.join(30)
    assert "error" not in box, box.get("error")
    assert (box["result"].text, box["result"].token_ids) == offline_greedy(target_llm, PROMPTS[0], 12)
    wait_released(target, draft)
    assert len(generate(stub, generate_request(PROMPTS[1], max_tokens=4)).token_ids) == 4
