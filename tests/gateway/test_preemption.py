"""A service whose KV pool preempts a sequence (ABORTED: it freed the blocks and forgot the sequence): the gateway
waits a moment and resends the whole history, the output does not change, and a preempted draft call is not a
draft failure (the circuit breaker stays closed)."""

from __future__ import annotations

import threading

import pytest

from gateway.resilience import CLOSED
from specdec.errors import SequencePreemptedError
from specdec.serving import metrics as M
from tests.metrics_helpers import parse, total
from tests.services_conftest_helpers import PROMPTS, generate, generate_request, offline_greedy

N = 16


class Preempting:
    """Wraps a backend's ``verify`` / ``propose``: the calls numbered in ``calls`` (1-based, from installation),
    or every call while ``always`` is set, are preempted as the pool does it: the sequence is released, then
    SequencePreemptedError. ``starts`` records the start_position of every request the service received."""

    def __init__(self, monkeypatch, backend, method: str, calls=()):
        self.backend, self.calls, self.always = backend, set(calls), False
        self.count = self.preempted = 0
        self.starts: list[int] = []
        self._lock = threading.Lock()
        original, history = getattr(backend, method), backend.history

        def wrapped(call, *args, **kwargs):
            with self._lock:
                self.count += 1
                preempt = self.always or self.count in self.calls
                self.preempted += preempt
            if preempt:
                backend.release(call.sequence_id)
                raise SequencePreemptedError(f"{backend.role}: the KV cache pool preempted {call.sequence_id!r}")
            return original(call, *args, **kwargs)

        def spy_history(sequence_id, start_position, new_token_ids):
            self.starts.append(start_position)
            return history(sequence_id, start_position, new_token_ids)

        monkeypatch.setattr(backend, method, wrapped)
        monkeypatch.setattr(backend, "history", spy_history)


@pytest.fixture(scope="module")
def trio(servers, target_dir, good_draft_dir):
    target, draft = servers.target(target_dir), servers.draft(good_draft_dir)
    # one counted draft failure would open the breaker; the draft's deadline bounds a preempted Propose's retries
    gw = servers.gateway(target, draft, draft_breaker_failures=1, draft_timeout_ms=1000)
    from specdec.v1 import generation_service_pb2_grpc
    import grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{gw.port}")
    yield target, draft, gw, generation_service_pb2_grpc.GenerationServiceStub(channel)
    channel.close()


def _samples():
    return parse(M.exposition().decode())


def test_a_preempted_verify_is_resent_whole_and_the_output_is_the_same(trio, target_llm, monkeypatch):
    target, draft, gw, stub = trio
    model = gw.backend.served_model_name
    before = _samples()
    preempting = Preempting(monkeypatch, target.backend, "verify", calls={2, 3, 5})
    out = generate(stub, generate_request(PROMPTS[0], max_tokens=N, k=2))
    assert (out.text, out.token_ids) == offline_greedy(target_llm, PROMPTS[0], N)
    assert preempting.preempted == 3
    # after each preemption the history came whole (start_position 0), and otherwise only what was new
    starts = preempting.starts
    assert starts[0] == 0 and starts[2] == starts[3] == starts[5] == 0, starts
    assert all(s > 0 for i, s in enumerate(starts) if i not in (0, 2, 3, 5)), starts
    resends = total(_samples(), "specdec_history_resends_total", service="gateway", model_name=model, phase="verify")
    assert resends - total(before, "specdec_history_resends_total", service="gateway", model_name=model,
                           phase="verify") == 3
    assert gw.backend.draft.breaker.state == CLOSED


def test_a_preempted_propose_is_resent_and_does_not_open_the_breaker(trio, target_llm, monkeypatch):
    target, draft, gw, stub = trio
    preempting = Preempting(monkeypatch, draft.backend, "propose", calls={1, 2, 4})
    out = generate(stub, generate_request(PROMPTS[1], max_tokens=N, k=2))
    assert (out.text, out.token_ids) == offline_greedy(target_llm, PROMPTS[1], N)
    assert preempting.preempted == 3 and preempting.starts[1] == preempting.starts[2] == preempting.starts[4] == 0
    assert gw.backend.draft.breaker.state == CLOSED
    assert out.last.stats.num_draft_tokens > 0  # the retries got their proposals: every round drafted


@pytest.mark.heavy
def test_a_draft_that_keeps_preempting_costs_drafts_not_output_nor_the_breaker(trio, target_llm, monkeypatch):
    """Past the draft's deadline the round verifies without drafts (reason "preempted"); the breaker, which one
    counted failure would open here, stays closed, and the output is the target's."""
    target, draft, gw, stub = trio
    model = gw.backend.served_model_name
    before = _samples()
    preempting = Preempting(monkeypatch, draft.backend, "propose")
    preempting.always = True
    out = generate(stub, generate_request(PROMPTS[0], max_tokens=6, k=2))
    assert (out.text, out.token_ids) == offline_greedy(target_llm, PROMPTS[0], 6)
    assert out.last.stats.num_draft_tokens == 0 and preempting.preempted > 1
    assert gw.backend.draft.breaker.state == CLOSED
    after = _samples()
    reasons = {r: total(after, "specdec_rounds_without_draft_total", service="gateway", model_name=model, reason=r)
               - total(before, "specdec_rounds_without_draft_total", service="gateway", model_name=model, reason=r)
               for r in ("preempted", "draft_failed", "breaker_open")}
    assert reasons["preempted"] >= 1 and reasons["draft_failed"] == reasons["breaker_open"] == 0, reasons
    preempting.always = False  # and the draft drafts again at once
    again = generate(stub, generate_request(PROMPTS[0], max_tokens=6, k=2))
    assert again.token_ids == out.token_ids and again.last.stats.num_draft_tokens > 0
