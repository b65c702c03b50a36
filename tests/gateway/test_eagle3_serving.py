"""EAGLE-3 across services: the target returns its features with each Verify, the gateway hands them to the draft
service with the next Propose, and the output is the target's alone; through ``specdec serve`` and through
separate processes whose draft and target are killed (SIGKILL) and restarted, or evict the sequence, mid-stream."""

from __future__ import annotations

import json

import grpc
import pytest

from specdec.entrypoints.serve import ServeConfig, start_stack
from specdec.serving import metrics as M
from specdec.v1 import (common_pb2, draft_service_pb2_grpc, generation_service_pb2_grpc, target_service_pb2,
                        target_service_pb2_grpc)
from tests.metrics_helpers import delta, parse, total
from tests.service_processes import ServiceProcess
from tests.services_conftest_helpers import collect, generate, generate_request, hooked, run_in_thread

N = 16  # the prompts leave 16 tokens of the target's own answer to generate again


def _reference(target_llm, prompts):
    from specdec import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    return [o.outputs[0].token_ids for o in target_llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.mark.heavy
def test_served_eagle3_is_the_target_alone(target_dir, eagle3_head_dir, eagle3_prompts, target_llm):
    stack = start_stack(ServeConfig(model=str(target_dir), host="127.0.0.1", grpc_port=0, port=-1, dtype="float32",
                                    speculative_config=json.dumps({"method": "eagle3", "model": str(eagle3_head_dir),
                                                                   "num_speculative_tokens": 3})))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{stack.gateway.port}") as channel:
            stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
            info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
            assert info.draft.method == "eagle3" and len(info.draft.feature_layers) == 3
            assert info.draft.kv_cache_capacity_tokens == 0  # the head keeps its own cache, no KV pool
            accepted = 0
            before = parse(M.exposition().decode())
            for prompt, ref in zip(eagle3_prompts, _reference(target_llm, eagle3_prompts)):
                out = generate(stub, generate_request(prompt_token_ids=prompt, max_tokens=N))
                assert out.token_ids == ref
                accepted += out.last.stats.num_accepted_tokens
            assert accepted > 0  # features crossed the services: the head drafted from them
            # every position of every prompt and answer once (bf16, 3 x 64 wide), counted by the gateway
            relayed = delta(parse(M.exposition().decode()), before, "specdec_feature_bytes_total", service="gateway",
                            model_name=str(target_dir))
            assert relayed >= sum(len(p) for p in eagle3_prompts) * 3 * 64 * 2, relayed
        # the target's side of it: features of the asked layers, in bf16 by default, refused for a layer it lacks
        with grpc.insecure_channel(f"127.0.0.1:{stack.target.port}") as channel:
            target = target_service_pb2_grpc.TargetServiceStub(channel)
            resp = target.Verify(target_service_pb2.VerifyRequest(
                sequence_id="features", new_token_ids=eagle3_prompts[0][:12], feature_layers=[0, 1, 2]), timeout=30)
            f = resp.features
            assert (f.start_position, f.num_positions, f.width) == (0, 12, 3 * 64)
            assert f.dtype == common_pb2.FEATURE_DTYPE_BFLOAT16 and len(f.data) == 12 * 3 * 64 * 2
            plain = target.Verify(target_service_pb2.VerifyRequest(sequence_id="plain", new_token_ids=[1, 2, 3]),
                                  timeout=30)
            assert not plain.HasField("features")
            with pytest.raises(grpc.RpcError) as err:
                target.Verify(target_service_pb2.VerifyRequest(sequence_id="bad", new_token_ids=[1, 2],
                                                               feature_layers=[0, 7]), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "feature_layers" in err.value.details()
    finally:
        stack.stop(0)


@pytest.mark.heavy
def test_served_eagle3_trees_are_the_target_alone(target_dir, eagle3_head_dir, eagle3_prompts, target_llm):
    """The head's token trees across services: Propose returns draft_parents, the target verifies each tree in one
    pass and returns the accepted path's features, and the output is the target's alone."""
    spec = {"method": "eagle3", "model": str(eagle3_head_dir), "num_speculative_tokens": 3,
            "speculative_token_tree": "dynamic", "speculative_eagle_topk": 3, "speculative_num_draft_tokens": 10}
    stack = start_stack(ServeConfig(model=str(target_dir), host="127.0.0.1", grpc_port=0, port=-1, dtype="float32",
                                    speculative_config=json.dumps(spec)))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{stack.gateway.port}") as channel, \
                hooked(stack.gateway.backend.target, "verify") as hook:
            stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
            accepted = 0
            for prompt, ref in zip(eagle3_prompts, _reference(target_llm, eagle3_prompts)):
                out = generate(stub, generate_request(prompt_token_ids=prompt, max_tokens=N))
                assert out.token_ids == ref
                accepted += out.last.stats.num_accepted_tokens
        trees = [(args[2], result) for args, result in hook.seen if args[2].is_tree]
        assert trees and accepted > 0
        for proposal, result in trees:  # each tree's path, with a feature per position it decided
            assert len(result.accepted_path) == result.num_accepted_tokens <= len(proposal.draft_token_ids)
    finally:
        stack.stop(0)


@pytest.mark.heavy
@pytest.mark.parametrize("merge_score", [0.0, 100.0])
def test_served_suffix_decoding_before_the_head(target_dir, eagle3_head_dir, eagle3_prompts, target_llm, merge_score):
    """enable_suffix_decoding across services: the draft service's suffix trees propose where they match (each
    prompt is sent twice: the global tree holds the first answer), the head elsewhere; the head takes every round's
    features either way, so each position's features cross the wire about once; the output is the target's
    alone. With suffix_decoding_merge_score the suffix trees share their rounds with the head's (merged trees), and
    /metrics counts the rounds by drafter."""
    spec = {"method": "eagle3", "model": str(eagle3_head_dir), "num_speculative_tokens": 8,
            "enable_suffix_decoding": True, "draft_model_num_speculative_tokens": 3,
            "speculative_token_tree": "dynamic", "speculative_eagle_topk": 3, "speculative_num_draft_tokens": 10,
            "suffix_decoding_merge_score": merge_score}
    stack = start_stack(ServeConfig(model=str(target_dir), host="127.0.0.1", grpc_port=0, port=-1, dtype="float32",
                                    speculative_config=json.dumps(spec)))
    try:
        head = stack.draft.backend.worker.model  # the hybrid's head
        rounds = {"head": 0, "suffix": 0}
        original_propose, original_absorb = head.propose_batch, head.absorb

        def propose(calls):
            rounds["head"] += len(calls)
            return original_propose(calls)

        def absorb(calls):
            rounds["suffix"] += sum(1 for c in calls if c.features)
            return original_absorb(calls)

        head.propose_batch, head.absorb = propose, absorb
        with grpc.insecure_channel(f"127.0.0.1:{stack.gateway.port}") as channel:
            stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
            assert stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10).draft.method == "eagle3"
            prompts = eagle3_prompts[:3]
            refs = _reference(target_llm, prompts)
            before = parse(M.exposition().decode())
            accepted = []
            for prompt, ref in list(zip(prompts, refs)) * 2:
                out = generate(stub, generate_request(prompt_token_ids=prompt, max_tokens=N))
                assert out.token_ids == ref
                accepted.append(out.last.stats.num_accepted_tokens)
            after = parse(M.exposition().decode())
        by_drafter = {d: total(after, "specdec_hybrid_draft_rounds", service="draft", drafter=d,
                               model_name=str(eagle3_head_dir)) for d in ("lookup", "model", "merged")}
        assert by_drafter == stack.draft.backend.worker.rounds and by_drafter["model"] > 0, by_drafter
        if merge_score:  # every suffix round merged: the head drafted each round, and took its features so
            assert rounds["head"] > by_drafter["model"] and by_drafter["merged"] > 0, (rounds, by_drafter)
        else:
            assert rounds["suffix"] > 0 and by_drafter["lookup"] > 0 and by_drafter["merged"] == 0, by_drafter
        assert rounds["head"] > 0 and sum(accepted) > 0, (rounds, accepted)
        relayed = delta(after, before, "specdec_feature_bytes_total", service="gateway", model_name=str(target_dir))
        positions = 2 * sum(len(p) + N for p in prompts)
        assert 0 < relayed <= 1.5 * positions * 3 * 64 * 2, (relayed, positions)
    finally:
        stack.stop(0)


@pytest.fixture(scope="module")
def processes(target_dir, eagle3_head_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("eagle3-logs")
    target = ServiceProcess("target_service", ["--model", str(target_dir)], logs).start()
    draft = ServiceProcess("draft_service", ["--model", str(eagle3_head_dir), "--method", "eagle3",
                                             "--target-model", str(target_dir)], logs).start()
    try:
        yield target, draft
    finally:
        for proc in (target, draft):
            proc.kill()


@pytest.fixture(scope="module")
def gateway(processes, servers):
    from gateway.config import GatewayConfig
    from gateway.server import create_server

    target, draft = processes
    handle = servers.add(create_server(GatewayConfig(
        target_addr=target.address, draft_addr=draft.address, host="127.0.0.1", port=0, num_speculative_tokens=3,
        backend_timeout_seconds=60.0, startup_timeout_seconds=60.0, draft_breaker_failures=1,
        draft_breaker_reset_seconds=0.3)))
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    yield handle.backend, generation_service_pb2_grpc.GenerationServiceStub(channel)
    channel.close()


@pytest.mark.heavy
def test_killed_and_evicted_services_mid_stream(processes, gateway, eagle3_prompts, target_llm):
    """Before the 4th Verify: the draft killed (the rest without drafts), the draft or the target restarted
    (SIGKILL, a new process on the port), or either evicting the sequence. The text is the target's every time;
    after a draft restart the head drafts again (the target fed the history again for its features)."""
    target, draft = processes
    gw, stub = gateway
    prompt = eagle3_prompts[0]
    (reference,) = _reference(target_llm, [prompt])

    def restart(proc):
        def interrupt(_sid):
            proc.kill()
            proc.start()
        return interrupt

    def evict(proc, stub_cls):
        def interrupt(sid):
            with grpc.insecure_channel(proc.address) as ch:
                assert stub_cls(ch).ReleaseSequence(common_pb2.ReleaseSequenceRequest(sequence_id=sid),
                                                    timeout=10).released
        return interrupt

    def kill(proc):
        def interrupt(_sid):
            proc.kill()
        return interrupt

    cases = [("draft evicted", evict(draft, draft_service_pb2_grpc.DraftServiceStub)),
             ("target evicted", evict(target, target_service_pb2_grpc.TargetServiceStub)),
             ("target restarted", restart(target)),
             ("draft restarted", restart(draft)),
             ("draft killed", kill(draft))]
    for name, interrupt in cases:
        with hooked(gw.target, "verify") as hook:
            hook.pause_at(4)
            thread, box = run_in_thread(lambda: collect(stub.Generate(
                generate_request(prompt_token_ids=prompt, max_tokens=N), timeout=180)))
            hook.wait_paused(60)
            (sid,) = list(gw.target._held)
            interrupt(sid)
            hook.resume()
            thread.join(180)
        assert not thread.is_alive() and "error" not in box, (name, box.get("error"))
        out = box["result"]
        assert out.token_ids == reference, name
        if name != "draft killed":
            assert out.last.stats.num_accepted_tokens > 0, name
    draft.start()


@pytest.mark.heavy
@pytest.mark.parametrize("setting, message", [({"overlap": True}, "--no-overlap"),
                                              ({"use_heterogeneous_vocab": True}, "--no-use-heterogeneous-vocab")])
def test_a_gateway_refuses_what_an_eagle_draft_cannot_do(processes, setting, message):
    from gateway.config import GatewayConfig
    from gateway.server import create_server
    from specdec.errors import ConfigError

    target, draft = processes
    with pytest.raises(ConfigError, match=message):
        create_server(GatewayConfig(target_addr=target.address, draft_addr=draft.address, host="127.0.0.1", port=0,
                                    startup_timeout_seconds=60.0, **setting))
