"""Both services' KV caches are freed when a stream completes, is cancelled, or runs out of time."""

from __future__ import annotations

import grpc

from tests.services_conftest_helpers import (
    PROMPTS,
    generate,
    generate_request,
    hooked,
    rpc_error,
    sequences_of,
    wait_released,
)


def _held_by_gateway(stack) -> dict:
    gw = stack.gateway.backend
    return {**gw.target._held, **gw.draft._held}


def test_completed_stream_releases_both_caches(stack, gen_stub):
    out = generate(gen_stub, generate_request(PROMPTS[0], max_tokens=20, k=3))
    assert len(out.token_ids) == 20
    wait_released(stack.target, stack.draft)
    assert not _held_by_gateway(stack)


def test_cancelled_stream_releases_both_caches(stack, gen_stub):
    gateway = stack.gateway.backend
    with hooked(gateway.target, "verify") as hook:
        hook.pause_at(3)
        responses = gen_stub.Generate(generate_request(PROMPTS[1], max_tokens=200, k=1), timeout=60)
        first = next(responses)
        assert first.token_ids
        hook.wait_paused()  # mid-stream: both services hold the sequence
        assert len(sequences_of(stack.target)) == 1 and len(sequences_of(stack.draft)) == 1
        responses.cancel()
        hook.resume()
        err = rpc_error(lambda: list(responses))
        assert err.code() == grpc.StatusCode.CANCELLED
        wait_released(stack.target, stack.draft)
    assert hook.calls < 50, "the gateway kept generating for a cancelled client"
    assert not _held_by_gateway(stack)
    # the gateway still serves
    assert len(generate(gen_stub, generate_request(PROMPTS[0], max_tokens=4)).token_ids) == 4


def test_tiny_client_deadline_is_deadline_exceeded_and_releases(stack, gen_stub):
    err = rpc_error(lambda: gen_stub.Generate(generate_request(PROMPTS[0], max_tokens=200, k=1), timeout=0.05))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_released(stack.target, stack.draft)
    assert not _held_by_gateway(stack)
    assert len(generate(gen_stub, generate_request(PROMPTS[1], max_tokens=4)).token_ids) == 4


def test_client_deadline_is_propagated_to_the_backends(stack, gen_stub):
    """Every backend call carries what is left of the client's deadline, and the gateway stops there.

    Each Verify is paced to take >= 20 ms, so a 0.5 s deadline allows at most ~25 target passes;
    200 tokens at k=1 need at least 100 (a round emits at most 2 tokens)."""
    import time

    stack.target.backend.batch_sizes.clear()
    timeouts = []
    with hooked(stack.gateway.backend.target._stub, "Verify") as hook:
        original = hook.original

        def verify(request, timeout=None, **kw):
            timeouts.append(timeout)
            time.sleep(0.02)
            return original(request, timeout=timeout, **kw)

        hook.original = verify
        err = rpc_error(lambda: gen_stub.Generate(generate_request(PROMPTS[0], max_tokens=200, k=1), timeout=0.5))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert timeouts and all(t is not None and 0 < t <= 0.5 for t in timeouts), timeouts
    assert timeouts == sorted(timeouts, reverse=True)  # the time left shrinks call after call
    wait_released(stack.target, stack.draft)
    assert not _held_by_gateway(stack)
    passes = len(stack.target.backend.batch_sizes)
    assert passes <= 30, f"{passes} target passes after a 0.5 s deadline: the gateway kept going for nobody"


def test_deadline_while_backend_is_slow_is_deadline_exceeded(stack, gen_stub):
    """A target call that outlives the client's deadline ends the stream with DEADLINE_EXCEEDED."""
    gateway = stack.gateway.backend
    with hooked(gateway.target, "verify") as hook:
        hook.pause_at(2)
        responses = gen_stub.Generate(generate_request(PROMPTS[0], max_tokens=50, k=1), timeout=1.0)
        assert next(responses).token_ids
        hook.wait_paused()
        err = rpc_error(lambda: list(responses))  # the client's deadline passes while paused
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        hook.resume()
        wait_released(stack.target, stack.draft)
    assert hook.calls <= 3
    assert not _held_by_gateway(stack)
