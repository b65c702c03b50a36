"""A seeded sampled request gives the same output whether or not a service restarts (SIGKILL, then a
new process on the same port) or evicts the sequence in the middle of the stream, and (the coupled rule,
the target's default ``seeded_sampling``) whether or not the draft is there at all: a draft killed
mid-stream, the rest of the stream decoded by the target alone behind the open breaker, gives the
uninterrupted text, which is also what the offline target alone (speculation off) gives.

The services are separate processes; the gateway runs in the test's process so a hook can park its
thread before a given call while the test kills a service (see tests/services_conftest_helpers.Hook).
Each rebuilt sequence must draw exactly the random numbers the uninterrupted one drew: the draws are
a function of (seed, role, committed length), never of how long the process has held the sequence;
under the coupled rule every emitted token is the target's race at its position, a function of (seed,
position) only.
"""

from __future__ import annotations

import grpc
import pytest

from specdec import SamplingParams
from specdec.v1 import common_pb2, draft_service_pb2_grpc, generation_service_pb2_grpc, target_service_pb2_grpc
from tests.service_processes import service_pair
from tests.services_conftest_helpers import PROMPTS, collect, generate, generate_request, hooked, run_in_thread

MAX_TOKENS = 32
SEED = 1234
TOP_P = 0.95


@pytest.fixture(scope="module")
def processes(target_dir, good_draft_dir, tmp_path_factory):
    yield from service_pair(target_dir, good_draft_dir, tmp_path_factory.mktemp("service-logs"))


@pytest.fixture(scope="module")
def gateway(processes, servers):
    from gateway.server import create_server
    from gateway.config import GatewayConfig

    target, draft = processes
    handle = servers.add(create_server(GatewayConfig(
        target_addr=target.address, draft_addr=draft.address, host="127.0.0.1", port=0, num_speculative_tokens=3,
        draft_sample_method="probabilistic", backend_timeout_seconds=60.0, startup_timeout_seconds=60.0,
        draft_breaker_failures=1, draft_breaker_reset_seconds=0.5)))
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    yield handle.backend, generation_service_pb2_grpc.GenerationServiceStub(channel)
    channel.close()


def _request(prompt: str, seed: int = SEED):
    req = generate_request(prompt, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
    req.sampling_params.top_p = TOP_P
    return req


def _interrupted(gateway, stub, prompt: str, at_verify: int, interrupt):
    """Run the request; before its ``at_verify``-th Verify call, run ``interrupt(sequence_id)``. → (token ids,
    Verify calls, the last response's stats)."""
    gw, stub = gateway, stub
    with hooked(gw.target, "verify") as hook:
        hook.pause_at(at_verify)
        thread, box = run_in_thread(lambda: collect(stub.Generate(_request(prompt), timeout=180)))
        hook.wait_paused(60)
        (sequence_id,) = list(gw.target._held)
        interrupt(sequence_id)
        hook.resume()
        thread.join(180)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    out = box["result"]
    return out.token_ids, hook.calls, out.last.stats


@pytest.mark.heavy
def test_seeded_sampled_output_survives_restarts_and_evictions(processes, gateway, target_llm):
    target, draft = processes
    gw, stub = gateway
    first = generate(stub, _request(PROMPTS[0]))
    reference = first.token_ids
    assert len(reference) == MAX_TOKENS
    assert first.last.stats.num_accepted_tokens > 0  # the draft drafted, and some drafts were accepted
    offline = target_llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, top_p=TOP_P, seed=SEED,
                                                             max_tokens=MAX_TOKENS, ignore_eos=True))
    assert offline[0].outputs[0].token_ids == reference, "the served text is not the offline target alone's"
    again = generate(stub, _request(PROMPTS[0])).token_ids
    assert again == reference, "a seeded request is not reproducible even without interruptions"
    other_seed = generate(stub, _request(PROMPTS[0], seed=SEED + 1)).token_ids
    assert other_seed != reference, "the seed does not reach the sampling"

    def restart(proc):
        def interrupt(_sequence_id):
            proc.kill()  # SIGKILL: the process and every cache in it are gone
            proc.start()
        return interrupt

    def evict(proc, stub_cls):
        def interrupt(sequence_id):
            channel = grpc.insecure_channel(proc.address)
            try:
                released = stub_cls(channel).ReleaseSequence(
                    common_pb2.ReleaseSequenceRequest(sequence_id=sequence_id), timeout=10).released
            finally:
                channel.close()
            assert released, "the service did not hold the sequence"
        return interrupt

    def kill(proc):
        def interrupt(_sequence_id):
            proc.kill()  # SIGKILL; not started again until the stream is over
        return interrupt

    cases = {
        "draft killed": kill(draft),
        "draft restarted": restart(draft),
        "target restarted": restart(target),
        "draft evicted": evict(draft, draft_service_pb2_grpc.DraftServiceStub),
        "target evicted": evict(target, target_service_pb2_grpc.TargetServiceStub),
    }
    for name, interrupt in cases.items():
        tokens, verify_calls, stats = _interrupted(gw, stub, PROMPTS[0], 4, interrupt)
        assert verify_calls > 4, f"{name}: the interruption was not in the middle of the stream"
        assert tokens == reference, f"{name}: seeded output changed"
        if name == "draft killed":  # the rest of the stream ran on the target alone, behind the open breaker
            assert gw.draft.breaker.state == "open"
            assert stats.num_drafts <= 4 < stats.num_target_passes, stats  # drafted up to the kill, then not
            draft.start()
