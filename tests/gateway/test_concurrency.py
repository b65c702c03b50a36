"""Concurrent streams through the gateway are batched by the backends and stay exact."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from tests.services_conftest_helpers import (
    PROMPTS,
    generate,
    generate_request,
    hooked,
    offline_greedy,
    wait_released,
)

NUM_STREAMS = 8
EXTRA_PROMPTS = ["Once upon a time", "import numpy as np\n", "The capital of France is", "1, 2, 3, 4,",
                 "Dear Sir or Madam,", "SELECT * FROM"]


def _requests():
    prompts = PROMPTS + EXTRA_PROMPTS
    # different prompts, lengths and k so the rows of a padded batch really differ
    return [generate_request(prompts[i % len(prompts)], max_tokens=16 + 2 * i, k=1 + i % 4, request_id=f"r{i}")
            for i in range(NUM_STREAMS)]


def _first_call_waits_for_all(call, n: int):
    """Wrap a client method so that each sequence's first call waits until n sequences are there."""
    barrier = threading.Barrier(n, timeout=30)
    seen: set[str] = set()
    lock = threading.Lock()

    def wrapper(sequence_id, *args, **kwargs):
        with lock:
            first = sequence_id not in seen
            seen.add(sequence_id)
        if first:
            barrier.wait()
        return call(sequence_id, *args, **kwargs)

    return wrapper


def test_concurrent_streams_match_solo_runs_and_are_batched(stack, gen_stub, target_llm):
    requests = _requests()
    solo = [generate(gen_stub, r) for r in requests]
    for req, out in zip(requests, solo):  # a solo stream is the target alone, greedy
        assert (out.text, out.token_ids) == offline_greedy(target_llm, req.prompt, req.max_tokens)

    target_backend = stack.target.backend
    draft_backend = stack.draft.backend
    target_backend.batch_sizes.clear()
    draft_backend.batch_sizes.clear()
    # Make the 8 streams reach each service together (their first Propose and first Verify wait
    # for all 8), so the batchers find several calls queued; the rest of each stream runs freely.
    with hooked(stack.gateway.backend.draft, "propose") as propose_hook, \
            hooked(stack.gateway.backend.target, "verify") as verify_hook, \
            hooked(target_backend.runner, "_forward_padded") as padded:
        for hook in (propose_hook, verify_hook):
            hook.original = _first_call_waits_for_all(hook.original, NUM_STREAMS)
        with ThreadPoolExecutor(NUM_STREAMS) as pool:
            together = list(pool.map(lambda r: generate(gen_stub, r), requests))

    for req, alone, out in zip(requests, solo, together):
        assert (out.text, out.token_ids) == (alone.text, alone.token_ids), req.request_id
        assert all(r.request_id == req.request_id for r in out.responses)
        assert out.last.completion_tokens == req.max_tokens
    assert max(target_backend.batch_sizes) > 1, f"the target never batched: {target_backend.batch_sizes}"
    assert sum(target_backend.batch_sizes) == sum(o.last.stats.num_target_passes for o in together)
    assert max(draft_backend.batch_sizes) > 1, f"the draft never batched: {draft_backend.batch_sizes}"
    assert max(target_backend.batch_sizes) <= target_backend.config.max_batch_size
    # and some of those batches were padded multi-sequence forward passes (not only prefills)
    assert padded.calls > 0, "the target never ran a padded batch of several sequences"
    wait_released(stack.target, stack.draft)
