"""Token trees served: a suffix draft service with --speculative-token-tree dynamic behind a gateway. Trees
travel over gRPC (ProposeResponse.draft_parents -> VerifyRequest.draft_parents -> VerifyResponse.accepted_path);
greedy output equals the target alone, and a draft restart mid-stream keeps it."""

from __future__ import annotations

import grpc
import pytest

from specdec.serving import metrics as M
from specdec.v1 import generation_service_pb2_grpc
from tests.metrics_helpers import parse, total
from tests.services_conftest_helpers import (collect, draft_config, generate, generate_request, hooked, offline_greedy,
                                             run_in_thread, wait_released)

N = 24
# the prompt's own suffix tree branches after "x. a b" (three continuations)
BRANCHING = "x. a b c d. x. a b e f. x. a b g h. x. a b"


@pytest.fixture(scope="module")
def tree_stack(servers, target_dir):
    target = servers.target(target_dir)
    draft = servers.draft("suffix", method="suffix", speculative_token_tree="dynamic")
    gw = servers.gateway(target, draft, num_speculative_tokens=12)
    channel = grpc.insecure_channel(f"127.0.0.1:{gw.port}")
    yield {"target": target, "draft": draft, "gateway": gw,
           "stub": generation_service_pb2_grpc.GenerationServiceStub(channel)}
    channel.close()


def test_trees_travel_and_the_output_is_the_target_alone(tree_stack, target_llm):
    st = tree_stack
    with hooked(st["gateway"].backend.target, "verify") as hook:
        first = generate(st["stub"], generate_request(BRANCHING, max_tokens=N, k=12))
        again = generate(st["stub"], generate_request(BRANCHING, max_tokens=N, k=12))
    reference = offline_greedy(target_llm, BRANCHING, N)
    assert (first.text, first.token_ids) == reference == (again.text, again.token_ids)
    trees = [(args[2], result) for args, result in hook.seen if args[2].is_tree]
    assert trees, "no tree reached the target"
    for proposal, result in trees:
        assert result.accepted_path is not None and len(result.accepted_path) == result.num_accepted_tokens
    assert again.last.stats.num_accepted_tokens > 0
    # the gateway counts tree rounds, their nodes and their accepted paths (rates give nodes and path per pass)
    text = parse(M.exposition().decode())
    rounds = total(text, "specdec_spec_decode_num_tree_drafts_total", service="gateway")
    nodes = total(text, "specdec_spec_decode_num_tree_draft_tokens_total", service="gateway")
    path = total(text, "specdec_spec_decode_num_tree_accepted_tokens_total", service="gateway")
    assert rounds >= len(trees) and nodes >= sum(len(p.draft_token_ids) for p, _ in trees)
    assert sum(r.num_accepted_tokens for _, r in trees) <= path <= nodes
    wait_released(st["target"], st["draft"])


def test_draft_restart_mid_stream_keeps_the_output(servers, tree_stack, target_llm):
    from draft_service.server import create_server

    st = tree_stack
    request = generate_request(BRANCHING, max_tokens=N, k=12)
    with hooked(st["gateway"].backend.target, "verify") as hook:
        hook.pause_at(2)
        thread, box = run_in_thread(lambda: collect(st["stub"].Generate(request, timeout=120)))
        hook.wait_paused()
        st["draft"] = servers.restart(st["draft"], lambda port: create_server(
            draft_config("suffix", method="suffix", speculative_token_tree="dynamic", port=port)))
        hook.resume()
        thread.join(120)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    assert (box["result"].text, box["result"].token_ids) == offline_greedy(target_llm, BRANCHING, N)
    wait_released(st["target"], st["draft"])


def test_draft_model_trees_served_are_the_target_alone(servers, target_dir, good_draft_dir, target_llm):
    """A draft service drafting top-k trees with its model (speculative_token_tree dynamic): the trees reach the
    target through the gateway and the output is the target's."""
    from tests.services_conftest_helpers import PROMPTS

    target = servers.target(target_dir)
    draft = servers.draft(good_draft_dir, speculative_token_tree="dynamic", speculative_eagle_topk=3,
                          speculative_num_draft_tokens=10)
    gw = servers.gateway(target, draft, num_speculative_tokens=3)
    with grpc.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
        stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
        with hooked(gw.backend.target, "verify") as hook:
            for prompt in PROMPTS[:2]:
                got = generate(stub, generate_request(prompt, max_tokens=N, k=3))
                assert (got.text, got.token_ids) == offline_greedy(target_llm, prompt, N)
    trees = [args[2] for args, _ in hook.seen if args[2].is_tree]
    assert trees and all(len(p.draft_token_ids) <= 10 for p in trees)
    # at most the root's top 3 children; the likeliest node first (a root child), every parent before its children
    for p in trees:
        assert 1 <= p.parents.count(-1) <= 3 and p.parents[0] == -1, p.parents
        assert all(-1 <= parent < i for i, parent in enumerate(p.parents)), p.parents


def test_two_streams_share_one_passs_rows(servers, target_dir, good_draft_dir, target_llm):
    """Two streams' draft-model trees of 15 nodes in one verify pass are cut so that the pass fills no more 16-row
    tiles (--tree-tile-rows, 16 on a CPU) than chains of the trees' depths would: two whole trees (32 rows and
    more) would take a second tile. The cut nodes are counted on /metrics, and both outputs are the target's."""
    from specdec.trees import levels
    from tests.services_conftest_helpers import PROMPTS

    target = servers.target(target_dir)
    draft = servers.draft(good_draft_dir, speculative_token_tree="dynamic", speculative_eagle_topk=4,
                          speculative_num_draft_tokens=15)
    gw = servers.gateway(target, draft, num_speculative_tokens=3)
    worker = target.backend.worker
    runner = worker.runner
    passes: list[tuple[int, int, int]] = []  # (rows fed, rows of the same pass with chains, trees in it)
    original = runner.forward_batch

    def recording(seqs, news, *args, trees=None, **kw):
        if trees and sum(t is not None for t in trees) >= 2:
            chains = sum(len(n) - len(t or []) + (levels(t) if t else 0) for n, t in zip(news, trees))
            passes.append((sum(len(n) for n in news), chains, sum(t is not None for t in trees)))
        return original(seqs, news, *args, trees=trees, **kw)

    runner.forward_batch = recording
    cut_before = worker.tree_nodes_cut
    with grpc.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
        stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
        try:
            runs = [run_in_thread(lambda p=p: generate(stub, generate_request(p, max_tokens=N, k=3)))
                    for p in PROMPTS[:2]]
            for thread, _ in runs:
                thread.join(120)
        finally:
            del runner.forward_batch
    for prompt, (_, box) in zip(PROMPTS, runs):
        assert (box["result"].text, box["result"].token_ids) == offline_greedy(target_llm, prompt, N)
    assert passes, "no pass verified two trees"
    for rows, chains, _ in passes:  # never more tiles than the chains' (one tile at least)
        assert -(-rows // 16) <= max(1, -(-chains // 16)), (rows, chains)
    assert worker.tree_nodes_cut > cut_before  # two whole 15-node trees never fit one tile
    text = parse(M.exposition().decode())
    # (other targets of this process serve the same model: their series add to it)
    assert total(text, "specdec_tree_nodes_cut_total", service="target", model_name=str(target_dir)) >= \
        worker.tree_nodes_cut
