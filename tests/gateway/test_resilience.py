"""gateway.resilience in isolation: the circuit breaker's states on a fake clock, the draft fallback's
decisions, and admission's running/waiting slots."""

from __future__ import annotations

import threading

import pytest

from gateway.resilience import CLOSED, HALF_OPEN, OPEN, Admission, CircuitBreaker, FallbackDraft
from specdec.errors import (BackendUnavailableError, DeadlineExceededError, InvalidRequestError, ResourceExhaustedError,
                            SequencePreemptedError)
from specdec.proposal import Proposal
from specdec.sampling import SamplingParams


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_n_failures_probes_once_then_closes():
    clock, changes = Clock(), []
    b = CircuitBreaker(3, 5.0, on_change=lambda old, new: changes.append((old, new)), clock=clock)
    for _ in range(2):
        assert b.allow()
        b.record(False)
    assert b.state == CLOSED
    b.record(True)  # a success resets the count
    for _ in range(3):
        assert b.allow()
        b.record(False)
    assert b.state == OPEN and not b.allow()
    clock.now += 4.9
    assert not b.allow()
    clock.now += 0.2
    assert b.allow() and b.state == HALF_OPEN  # the one probe
    assert not b.allow()  # ... and only one
    b.record(False)
    assert b.state == OPEN and not b.allow()  # a failed probe opens it again at once
    clock.now += 5.1
    assert b.allow()
    b.record(True)
    assert b.state == CLOSED and b.allow() and b.allow()
    assert changes == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED)]


class FakeDraft:
    def __init__(self, outcomes):
        self.outcomes = list(outcomes)
        self.calls = 0
        self.call_timeout = None
        self.address = "fake:1"

    def propose(self, sequence_id, token_ids, k, params):
        self.calls += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return Proposal(outcome)

    def release(self, sequence_id):
        raise BackendUnavailableError("down")


def test_fallback_proposes_nothing_when_the_draft_fails_and_skips_it_while_open():
    clock = Clock()
    # (a call past its own deadline is BackendUnavailableError: see gateway.clients)
    remote = FakeDraft([[1, 2], BackendUnavailableError("down"), BackendUnavailableError("did not answer"), [3]])
    draft = FallbackDraft(remote, CircuitBreaker(2, 1.0, clock=clock), "m")
    params = SamplingParams(temperature=0)
    assert draft.propose("s", [1], 2, params).draft_token_ids == [1, 2]
    assert draft.propose("s", [1], 2, params).draft_token_ids == []  # failed: no drafts this round
    assert draft.propose("s", [1], 2, params).draft_token_ids == []  # failed again: the breaker opens
    assert draft.propose("s", [1], 2, params).draft_token_ids == [] and remote.calls == 3  # skipped
    clock.now += 1.5
    assert draft.propose("s", [1], 2, params).draft_token_ids == [3] and remote.calls == 4  # probe: back
    draft.release("s")  # a failing release never fails the request
    assert draft.address == "fake:1"  # the rest of the client's interface passes through


def test_a_clients_own_deadline_is_not_a_draft_failure():
    """The request's deadline passing during a Propose says nothing about the draft: it neither counts
    towards opening the breaker nor keeps a half-open breaker's probe, and the request ends with it."""
    clock = Clock()
    late = DeadlineExceededError("draft service: the request's deadline passed")
    remote = FakeDraft([late, late, late, BackendUnavailableError("down"), late, [7]])
    draft = FallbackDraft(remote, CircuitBreaker(2, 1.0, clock=clock), "m")
    params = SamplingParams(temperature=0)
    for _ in range(3):
        with pytest.raises(DeadlineExceededError):
            draft.propose("s", [1], 2, params)
    assert draft.breaker.state == CLOSED  # three expired deadlines: no failure counted
    draft.breaker.state, draft.breaker._opened_at = OPEN, clock.now  # (open, as after real failures)
    clock.now += 1.5
    assert draft.propose("s", [1], 2, params).draft_token_ids == []  # the probe fails: open again
    assert draft.breaker.state == OPEN
    clock.now += 1.5
    with pytest.raises(DeadlineExceededError):  # the probe's request ran out of time ...
        draft.propose("s", [1], 2, params)
    assert draft.breaker.state == HALF_OPEN  # ... which leaves the breaker as it was: the next call probes
    assert draft.propose("s", [1], 2, params).draft_token_ids == [7]
    assert draft.breaker.state == CLOSED


def test_fallback_keeps_a_callers_mistake_an_error():
    draft = FallbackDraft(FakeDraft([InvalidRequestError("bad k", param="k")]), CircuitBreaker(1, 1.0), "m")
    with pytest.raises(InvalidRequestError):
        draft.propose("s", [1], 2, SamplingParams(temperature=0))
    assert draft.breaker.state == CLOSED


def test_adaptive_timeout_follows_the_slowest_recent_call():
    draft = FallbackDraft(FakeDraft([]), CircuitBreaker(1, 1.0), "m")
    assert draft.call_timeout() == 2.0  # the floor
    draft._recent.extend([0.01, 0.9, 0.02])
    assert draft.call_timeout() == pytest.approx(4.5)
    assert FallbackDraft(FakeDraft([]), CircuitBreaker(1, 1.0), "m", timeout=0.25).call_timeout() == 0.25


def test_admission_refuses_at_once_past_running_plus_queue():
    a = Admission(max_running=2, max_waiting=1, max_queue_time=None)
    for _ in range(3):
        a.reserve(1)
    with pytest.raises(ResourceExhaustedError, match="--max-queue-len"):
        a.reserve(1)
    a.start()
    a.start()
    assert (a.running, a.waiting) == (2, 1)
    started = threading.Event()
    t = threading.Thread(target=lambda: (a.start(), started.set()))
    t.start()
    assert not started.wait(0.1)  # waits for a slot
    a.finish()
    t.join(5)
    assert started.is_set() and (a.running, a.waiting) == (2, 0)


def test_admission_wait_is_bounded_and_cancel_gives_the_place_back():
    a = Admission(max_running=1, max_waiting=2, max_queue_time=0.05)
    a.reserve(1)
    a.start()
    a.reserve(1)
    with pytest.raises(ResourceExhaustedError, match="--max-queue-time-seconds"):
        a.start()
    assert (a.running, a.waiting) == (1, 0)
    a.reserve(2)
    a.cancel()
    a.cancel()
    assert a.waiting == 0


def test_fallback_takes_a_preempted_draft_as_answering_not_failing():
    remote = FakeDraft([SequencePreemptedError("pool full"), SequencePreemptedError("pool full"), [4]])
    draft = FallbackDraft(remote, CircuitBreaker(1, 1.0), "m")
    params = SamplingParams(temperature=0)
    assert draft.propose("s", [1], 2, params).draft_token_ids == []  # no drafts this round ...
    assert draft.propose("s", [1], 2, params).draft_token_ids == []
    assert draft.breaker.state == CLOSED  # ... but one failure would have opened it
    assert draft.propose("s", [1], 2, params).draft_token_ids == [4] and remote.calls == 3


def test_admission_waits_for_room_in_the_kv_budget():
    budget = [100]
    a = Admission(max_running=8, max_waiting=8, max_queue_time=None, kv_budget=lambda: budget[0])
    tokens = {"a": 60, "b": 50, "c": 30}
    sizes = {name: (lambda name=name: tokens[name]) for name in tokens}
    a.reserve(3)
    a.start(sizes["a"])  # alone, it always starts
    assert a.kv_tokens() == 60
    started = threading.Event()
    t = threading.Thread(target=lambda: (a.start(sizes["b"]), started.set()))
    t.start()
    assert not started.wait(0.1) and (a.running, a.waiting) == (1, 2)  # 60 + 50 > 100: b waits, a slot free
    a.start(sizes["c"])  # 60 + 30 fits
    tokens["a"] = 65  # the running sequences grow as they generate
    a.finish(sizes["c"])
    assert not started.wait(0.1)  # 65 + 50 still does not fit
    a.finish(sizes["a"])
    t.join(5)
    assert started.is_set() and (a.running, a.waiting, a.kv_tokens()) == (1, 0, 50)
    a.finish(sizes["b"])
    budget[0] = 0  # 0: unlimited
    a.reserve(2)
    a.start(lambda: 10**9)
    a.start(lambda: 10**9)
    assert a.running == 2


def test_admission_wait_for_kv_room_is_bounded_and_says_so():
    a = Admission(max_running=8, max_waiting=8, max_queue_time=0.05, kv_budget=lambda: 100)
    a.reserve(2)
    a.start(lambda: 90)
    with pytest.raises(ResourceExhaustedError, match="room in the KV cache.*90 of its 100 tokens.*needs 20"):
        a.start(lambda: 20)
    assert (a.running, a.waiting) == (1, 0)


def test_shedding_draft_skips_the_draft_at_the_batch_size():
    from gateway.resilience import SheddingDraft

    running = [1]
    remote = FakeDraft([[1, 2], [3]])
    draft = SheddingDraft(remote, lambda: running[0], 2, "m")
    params = SamplingParams(temperature=0)
    assert draft.propose("s", [1], 2, params).draft_token_ids == [1, 2]
    running[0] = 2
    assert draft.propose("s", [1], 2, params).draft_token_ids == [] and remote.calls == 1
    running[0] = 1
    assert draft.propose("s", [1], 2, params).draft_token_ids == [3]
