"""Concurrent streams through the gateway: stepped as one group, batched whole by the backends, and exact."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from specdec.serving import batching, metrics
from tests import metrics_helpers
from specdec.v1 import generation_service_pb2_grpc
from tests.services_conftest_helpers import (
    PROMPTS,
    collect,
    generate,
    generate_request,
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


class _Records:
    """Each scheduler step's group, and each service batch's sequence ids, in order."""

    def __init__(self, gateway, target_backend, draft_backend, wait_for: int = 0):
        self.steps: list[list[str]] = []
        self.target: list[list[str]] = []
        self.draft: list[list[str]] = []
        scheduler = gateway.scheduler
        step, may_step = scheduler._step, scheduler._may_step

        def gated() -> bool:  # the first step waits until every stream has joined
            return (bool(self.steps) or len(scheduler._members) >= wait_for) and may_step()

        def recording_step(group):
            self.steps.append([m.seq.sequence_id for m in group])
            return step(group)

        self._patches = [(scheduler, "_step", recording_step), (scheduler, "_may_step", gated)]
        self.hints: list = []  # the batch hint each call reached its service with
        for backend in (target_backend, draft_backend):
            submit = backend.batcher.submit
            self._patches.append((backend.batcher, "submit", lambda item, hint=None, submit=submit: (
                self.hints.append(hint), submit(item, hint))[1]))
        for backend, into in ((target_backend, self.target), (draft_backend, self.draft)):
            run = backend.batcher._run_batch
            self._patches.append((backend.batcher, "_run_batch",
                                  lambda calls, run=run, into=into: (into.append([c.sequence_id for c in calls]),
                                                                     run(calls))[1]))

    def __enter__(self):
        self._saved = [(obj, name, vars(obj).get(name)) for obj, name, _ in self._patches]
        for obj, name, fn in self._patches:
            setattr(obj, name, fn)
        return self

    def __exit__(self, *exc):
        for obj, name, saved in self._saved:
            if saved is None:
                delattr(obj, name)  # back to the class's method
            else:
                setattr(obj, name, saved)


def test_concurrent_streams_match_solo_runs_and_each_step_is_one_batch(stack, gen_stub, target_llm, monkeypatch):
    requests = _requests()
    solo = [generate(gen_stub, r) for r in requests]
    for req, out in zip(requests, solo):  # a solo stream is the target alone, greedy
        assert (out.text, out.token_ids) == offline_greedy(target_llm, req.prompt, req.max_tokens)

    # A batch waits for its whole group however long that takes here: a hint that did not match the
    # calls actually sent would now stall the test instead of passing by luck of timing.
    monkeypatch.setattr(batching, "GROUP_WAIT_S", 30.0)
    gateway = stack.gateway.backend
    monkeypatch.setattr(gateway.scheduler, "min_stall_seconds", 60.0)  # and no step is ever taken for stalled
    runner = stack.target.backend.runner
    passes: list[int] = []  # sequences per target pass
    forward_paged = runner._forward_paged
    monkeypatch.setattr(runner, "_forward_paged", lambda seqs, *a: (passes.append(len(seqs)), forward_paged(seqs, *a))[1])
    with _Records(gateway, stack.target.backend, stack.draft.backend, wait_for=NUM_STREAMS) as rec:
        with ThreadPoolExecutor(NUM_STREAMS) as pool:
            together = list(pool.map(lambda r: generate(gen_stub, r), requests))

    for req, alone, out in zip(requests, solo, together):
        assert (out.text, out.token_ids) == (alone.text, alone.token_ids), req.request_id
        assert all(r.request_id == req.request_id for r in out.responses)
        assert out.last.completion_tokens == req.max_tokens
    # every step's Verify calls ran as ONE target batch holding exactly the step's live sequences
    assert [sorted(b) for b in rec.target] == [sorted(g) for g in rec.steps]
    assert len(rec.steps[0]) == NUM_STREAMS
    assert rec.hints and all(h is not None and h[1] >= 1 for h in rec.hints)  # every call said its group's size
    assert sum(map(len, rec.target)) == sum(o.last.stats.num_target_passes for o in together)
    # and every step's Propose calls ONE draft batch (of the sequences that still had room to draft)
    # (a last step whose sequences have one token of budget left drafts nothing: no Propose batch)
    assert len(rec.draft) <= len(rec.steps)
    drafted = iter(rec.draft)
    for group in rec.steps:
        batch = next(drafted, [])
        assert set(batch) <= set(group)
    assert max(map(len, rec.draft)) == NUM_STREAMS
    assert max(passes) == NUM_STREAMS, "the target never ran one ragged pass over every stream"
    wait_released(stack.target, stack.draft)


def test_streams_that_start_and_end_at_different_times_match_solo_runs(stack, gen_stub):
    requests = _requests()[:5]
    solo = [generate(gen_stub, r) for r in requests]
    started = [threading.Event() for _ in requests]
    results: list = [None] * len(requests)

    def run(i: int) -> None:
        responses = []
        for response in gen_stub.Generate(requests[i], timeout=120):
            responses.append(response)
            if len(responses) == 2:
                started[i].set()  # the next stream joins once this one is two rounds in
        started[i].set()
        results[i] = collect(responses)

    threads = []
    for i in range(len(requests)):
        if i:
            assert started[i - 1].wait(120)
        threads.append(threading.Thread(target=run, args=(i,)))
        threads[-1].start()
    for t in threads:
        t.join(120)
    for req, alone, out in zip(requests, solo, results):
        assert out is not None and (out.text, out.token_ids) == (alone.text, alone.token_ids), req.request_id
    wait_released(stack.target, stack.draft)


def test_a_stalled_or_cancelled_stream_never_stalls_the_others(stack, gen_stub):
    slow_req = generate_request(PROMPTS[0], max_tokens=40, k=2, request_id="slow")
    gone_req = generate_request(PROMPTS[1], max_tokens=200, k=2, request_id="gone")
    other_req = generate_request(EXTRA_PROMPTS[0], max_tokens=30, k=3, request_id="other")
    slow_solo, other_solo = generate(gen_stub, slow_req), generate(gen_stub, other_req)

    slow = gen_stub.Generate(slow_req, timeout=120)
    first = next(slow)  # then this client stops reading until the others are done
    gone = gen_stub.Generate(gone_req, timeout=120)
    next(gone)
    gone.cancel()  # this client goes away mid-stream
    other = generate(gen_stub, other_req)  # finishes while one stream is stalled and one cancelled
    assert (other.text, other.token_ids) == (other_solo.text, other_solo.token_ids)
    rest = collect(slow)
    assert (first.text + rest.text, list(first.token_ids) + rest.token_ids) == (slow_solo.text, slow_solo.token_ids)
    wait_released(stack.target, stack.draft)


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_one_loop_per_request_still_available(servers, stack, gen_stub, overlap):
    """--no-group-rounds: each request runs its own loop (the mode bench_serving compares against); with
    --overlap each loop's lookaheads run on the gateway's pool."""
    gw = servers.gateway(stack.target, stack.draft, group_rounds=False, overlap=overlap)
    assert gw.backend.scheduler is None and (gw.backend._ahead_pool is not None) == overlap
    stub = generation_service_pb2_grpc.GenerationServiceStub(stack.channel(gw))
    requests = _requests()[:3]
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda r: generate(stub, r), requests))
    for req, out in zip(requests, together):
        alone = generate(gen_stub, req)
        assert (out.text, out.token_ids) == (alone.text, alone.token_ids), req.request_id
    servers.stop(gw)
    wait_released(stack.target, stack.draft)


def _lookaheads(outcome: str) -> float:
    samples = metrics_helpers.parse(metrics.exposition().decode())
    return metrics_helpers.total(samples, "specdec_spec_decode_lookaheads_total", outcome=outcome)


@pytest.mark.heavy
def test_overlapped_streams_match_the_target_alone_and_lookaheads_batch_whole(servers, stack, gen_stub, target_llm,
                                                                              monkeypatch):
    """--overlap with group rounds: each step's lookaheads go to the draft as one batch of their own while
    the target verifies, won bets skip the Propose phase, and every stream is still the target alone."""
    gw = servers.gateway(stack.target, stack.draft, overlap=True)
    stub = generation_service_pb2_grpc.GenerationServiceStub(stack.channel(gw))
    requests = _requests()
    monkeypatch.setattr(batching, "GROUP_WAIT_S", 30.0)  # a wrong hint stalls rather than passes by luck
    monkeypatch.setattr(gw.backend.scheduler, "min_stall_seconds", 60.0)
    used, dropped = _lookaheads("used"), _lookaheads("dropped")
    with _Records(gw.backend, stack.target.backend, stack.draft.backend, wait_for=NUM_STREAMS) as rec:
        with ThreadPoolExecutor(NUM_STREAMS) as pool:
            together = list(pool.map(lambda r: generate(stub, r), requests))
    plain = [generate(gen_stub, r) for r in requests]  # sequential rounds, one stream at a time
    for req, out, seq in zip(requests, together, plain):
        assert (out.text, out.token_ids) == offline_greedy(target_llm, req.prompt, req.max_tokens), req.request_id
        # greedy drafting proposes the same tokens whether drafted ahead or not: the draft service saw every
        # history right (a lookahead's drafts, replaced by a verification, never leaked into the next call)
        assert (out.last.stats.num_draft_tokens, out.last.stats.num_accepted_tokens) == (
            seq.last.stats.num_draft_tokens, seq.last.stats.num_accepted_tokens), req.request_id
    won, lost = _lookaheads("used") - used, _lookaheads("dropped") - dropped
    assert won > 0 and lost > 0, (won, lost)
    # one target batch per step, as without overlap; the draft ran the lookaheads as whole batches too
    assert [sorted(b) for b in rec.target] == [sorted(g) for g in rec.steps]
    assert max(map(len, rec.draft)) == NUM_STREAMS
    assert all(h is not None for h in rec.hints)  # lookaheads carry their phase's batch hint too
    servers.stop(gw)
    wait_released(stack.target, stack.draft)
