"""Suffix decoding served: a draft service with method "suffix" (no model) behind a gateway. Greedy output
equals the target alone; the global tree learns across requests (a repeated request's second run is
drafted from the first one's output) and is reported in /metrics; a draft-service restart mid-stream costs speed, not output."""

from __future__ import annotations

import grpc
import pytest

from specdec.serving import metrics as M
from tests.metrics_helpers import parse, total
from specdec.v1 import generation_service_pb2_grpc
from tests.services_conftest_helpers import (
    PROMPTS,
    collect,
    draft_config,
    generate,
    generate_request,
    hooked,
    offline_greedy,
    run_in_thread,
    sequences_of,
    wait_released,
)

N = 32


@pytest.fixture(scope="module")
def suffix_stack(servers, target_dir):
    target = servers.target(target_dir)
    draft = servers.draft("suffix", method="suffix")
    gw = servers.gateway(target, draft, num_speculative_tokens=16)
    channel = grpc.insecure_channel(f"127.0.0.1:{gw.port}")
    yield {"target": target, "draft": draft, "gateway": gw,
           "stub": generation_service_pb2_grpc.GenerationServiceStub(channel)}
    channel.close()


def test_suffix_serving_equals_the_target_alone_and_learns_across_requests(suffix_stack, target_llm):
    st = suffix_stack
    assert st["draft"].backend.lm is None  # no model loaded
    first = generate(st["stub"], generate_request(PROMPTS[1], max_tokens=N, k=16))
    again = generate(st["stub"], generate_request(PROMPTS[1], max_tokens=N, k=16))
    reference = offline_greedy(target_llm, PROMPTS[1], N)
    assert (first.text, first.token_ids) == reference == (again.text, again.token_ids)
    # the second run drafts from the first one's output, held in the draft service's global tree (drafts grow
    # with the match, up to factor 1 x its length: 1, 2, 4, 8, 16 tokens)
    assert again.last.stats.num_accepted_tokens >= N // 2, again.last.stats
    assert again.last.stats.num_target_passes <= first.last.stats.num_target_passes // 3, (first.last.stats,
                                                                                          again.last.stats)
    text = parse(M.exposition().decode())
    assert total(text, "specdec_suffix_cache_cached_requests", service="draft") >= 2
    assert total(text, "specdec_suffix_cache_bytes", service="draft") > 0
    wait_released(st["target"], st["draft"])


def test_draft_restart_mid_stream_keeps_the_output(servers, suffix_stack, target_llm):
    """The restarted draft has an empty global tree and gets the history resent: the stream continues,
    token for token the target's."""
    from draft_service.server import create_server

    st = suffix_stack
    request = generate_request(PROMPTS[0], max_tokens=N, k=8)
    with hooked(st["gateway"].backend.target, "verify") as hook:
        hook.pause_at(3)
        thread, box = run_in_thread(lambda: collect(st["stub"].Generate(request, timeout=120)))
        hook.wait_paused()
        assert len(sequences_of(st["draft"])) == 1
        st["draft"] = servers.restart(st["draft"], lambda port: create_server(
            draft_config("suffix", method="suffix", port=port)))
        assert not sequences_of(st["draft"])
        hook.resume()
        thread.join(120)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    assert (box["result"].text, box["result"].token_ids) == offline_greedy(target_llm, PROMPTS[0], N)
    assert hook.calls > 3
    wait_released(st["target"], st["draft"])


def test_concurrent_streams_with_variable_drafts_equal_the_target_alone(suffix_stack, target_llm):
    """The group scheduler verifies sequences whose suffix drafts differ in length in one pass (some draft
    nothing, some many): every stream is the target's."""
    from concurrent.futures import ThreadPoolExecutor

    st = suffix_stack
    del st["target"].backend.batch_sizes[:]  # (the batches of this test only)
    prompts = [PROMPTS[0], PROMPTS[1], "Hello", PROMPTS[0] + " The cat"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: generate(st["stub"], generate_request(p, max_tokens=24, k=16)), prompts))
    for prompt, out in zip(prompts, outs):
        assert (out.text, out.token_ids) == offline_greedy(target_llm, prompt, 24), prompt
    assert sum(o.last.stats.num_draft_tokens for o in outs) > 0
    assert max(st["target"].backend.batch_sizes) > 1, "the streams were never verified together"
    wait_released(st["target"], st["draft"])
