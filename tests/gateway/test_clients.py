"""gateway.clients: what the gateway remembers of each sequence a service may hold."""

from __future__ import annotations

import random
import time

import grpc
import pytest

from gateway.clients import RemoteTarget, shared_prefix
from gateway.deadlines import CallDeadline
from specdec.errors import BackendUnavailableError, DeadlineExceededError
from specdec.proposal import Proposal
from specdec.sampling import SamplingParams


class _DeadlineExceeded(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self):
        return "Deadline Exceeded"


class _Done:
    """A finished call's future (what ``ReleaseSequence.future`` returns)."""

    def cancelled(self):
        return False

    def exception(self):
        return None

    def add_done_callback(self, fn):
        fn(self)


class _Release:
    def __init__(self, released: list[str]):
        self.released = released

    def future(self, request, timeout=None):
        self.released.append(request.sequence_id)
        return _Done()


class _Stub:
    """Verify fails as a deadline does after the service already created the sequence."""

    def __init__(self):
        self.released: list[str] = []
        self.timeouts: list[float] = []
        self.ReleaseSequence = _Release(self.released)  # noqa: N815 - gRPC method name

    def Verify(self, request, timeout=None):  # noqa: N802 - gRPC method name
        self.timeouts.append(timeout)
        raise _DeadlineExceeded()


def test_every_call_has_a_deadline_and_a_hung_backend_is_unavailable_by_name():
    """No request deadline: the call still gets one (the floor, before anything was measured); running past
    it is UNAVAILABLE naming the backend (a replica set moves the sequence on; alone: 503), and the target
    is marked down. Past the request's own deadline it is DEADLINE_EXCEEDED, and the backend is not blamed."""
    client = RemoteTarget("127.0.0.1:1")
    client.call_deadline = CallDeadline(floor=1.5, factor=8.0)
    stub = client._stub = _Stub()
    downs = []
    client.on_unavailable = lambda: downs.append(1)
    try:
        with pytest.raises(BackendUnavailableError, match=r"target service at 127.0.0.1:1 did not answer within 1.5 s"):
            client.verify("s1", [1, 2, 3], Proposal([4]), SamplingParams(temperature=0))
        assert stub.timeouts == [1.5] and downs == [1]
        client.set_deadline("s2", time.monotonic() + 0.5)  # the client's deadline comes first
        with pytest.raises(DeadlineExceededError):
            client.verify("s2", [1, 2, 3], Proposal([4]), SamplingParams(temperature=0))
        assert 0 < stub.timeouts[-1] <= 0.5 and downs == [1]
    finally:
        client.close()


def test_a_calls_deadline_follows_the_backends_measured_times():
    deadline = CallDeadline(floor=2.0, factor=8.0)
    assert deadline.timeout(1) == 2.0 and deadline.timeout(1024) == 2.0  # unmeasured: the floor per 1024 tokens,
    assert deadline.timeout(4096) == pytest.approx(2.0 * 4 * 4)  # quadratic past that (attention's growth)
    deadline.observe(0.01, 1)
    assert deadline.timeout(1) == 2.0  # a fast backend: the floor
    deadline.observe(0.5, 3)
    assert deadline.timeout(1) == pytest.approx(4.0)  # 8 x the slowest recent call
    deadline.observe(1.0, 100)  # a prefill: 10 ms per token sent
    assert deadline.timeout(100) == pytest.approx(8.0)  # its own size: 8 x its time
    # past the largest measured prefill, its time x the square of the ratio: a long prompt is not cut
    assert deadline.timeout(5000) == pytest.approx(8 * 1.0 * 50 * 50)
    deadline.observe(30.0, 4000)
    assert deadline.timeout(8000) == pytest.approx(8 * 30.0 * 4)  # from the largest measured prefill
    assert deadline.timeout(2000) == pytest.approx(8 * 30.0 / 2)  # a smaller call: scaled down by its tokens
    # a decode round's deadline follows the decode rounds only: a prefill, slow for its tokens (in chunks beside
    # the decoding sequences), does not stretch it (a stopped backend is still found out in seconds)
    assert deadline.timeout(1) == pytest.approx(4.0)


def test_a_sequence_whose_first_call_failed_is_still_released():
    client = RemoteTarget("127.0.0.1:1")  # never connected: the stub stands in for the service
    stub = client._stub = _Stub()
    try:
        with pytest.raises(BackendUnavailableError):
            client.verify("s1", [1, 2, 3], Proposal([4]), SamplingParams(temperature=0))
        client.release("s1")
        assert stub.released == ["s1"]
        client.release("s1")  # once only
        assert stub.released == ["s1"]
        client.release("never-called")  # nothing was ever sent for it: nothing to release
        assert stub.released == ["s1"]
    finally:
        client.close()


def test_draft_probs_travel_to_the_target_as_the_draft_sent_them():
    """The gateway never uses q: the draft's sparse rows go into VerifyRequest as they came, with no
    dense [k, vocab] tensor in between (still decodable on demand)."""
    from gateway.clients import RemoteProposal
    from specdec.v1 import common_pb2, target_service_pb2

    rows = [common_pb2.TokenDistribution(token_ids=[4, 9], probs=[0.75, 0.25])]
    proposal = RemoteProposal([4], rows, vocab_size=262_144)
    sent = []

    class Stub:
        def Verify(self, request, timeout=None):  # noqa: N802 - gRPC method name
            sent.append(request)
            return target_service_pb2.VerifyResponse(num_accepted_tokens=1, bonus_token_id=7)

    client = RemoteTarget("127.0.0.1:1")
    client._stub = Stub()
    try:
        result = client.verify("s", [1, 2], proposal, SamplingParams(temperature=1.0, seed=0))
    finally:
        client.close()
    assert (result.num_accepted_tokens, result.next_token_id) == (1, 7)
    assert list(sent[0].draft_probs) == rows
    q = proposal.draft_probs
    assert q.shape == (1, 262_144) and float(q[0, 4]) == 0.75 and float(q[0, 9]) == 0.25 and float(q.sum()) == 1.0


def test_a_cut_remote_proposal_keeps_its_rows_in_wire_form():
    """The loop cuts a proposal longer than the budget; the kept q rows are still the draft's wire rows."""
    from gateway.clients import RemoteProposal
    from specdec.v1 import common_pb2

    rows = [common_pb2.TokenDistribution(token_ids=[t], probs=[1.0]) for t in (4, 5, 6)]
    proposal = RemoteProposal([4, 5, 6], rows, vocab_size=16)
    assert proposal.truncated(3) is proposal
    cut = proposal.truncated(2)
    assert isinstance(cut, RemoteProposal) and cut.draft_token_ids == [4, 5] and cut.wire_probs == rows[:2]
    assert cut.draft_probs.shape == (2, 16)


def test_a_service_that_cannot_serve_is_backend_unavailable_not_an_internal_error():
    """FAILED_PRECONDITION (e.g. its model failed to load) reaches HTTP clients as a 503."""
    from specdec.errors import BackendUnavailableError

    class Failed(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.FAILED_PRECONDITION

        def details(self):
            return "the model failed to load: ModelNotFoundError: /models/x"

    class Stub:
        def Verify(self, request, timeout=None):  # noqa: N802 - gRPC method name
            raise Failed()

    client = RemoteTarget("127.0.0.1:1")
    client._stub = Stub()
    try:
        with pytest.raises(BackendUnavailableError, match="failed to load"):
            client.verify("s", [1], Proposal([]), SamplingParams(temperature=0))
    finally:
        client.close()


def test_a_client_sends_what_follows_the_history_it_last_sent():
    from gateway.clients import shared_prefix

    assert shared_prefix([], [1, 2]) == 0
    assert shared_prefix([1, 2], [1, 2, 3]) == 2  # the history grew: send [3]
    assert shared_prefix([1, 2, 3, 4], [1, 2, 3]) == 3
    assert shared_prefix([1, 2, 8, 9], [1, 2, 3, 4, 5]) == 2  # a lookahead's drafts [8, 9] lost: resend from 3
    assert shared_prefix([5], [6]) == 0


class _Aborted(grpc.RpcError):
    """What a service answers when its KV pool preempted the sequence (ABORTED: SequencePreemptedError)."""

    def code(self):
        return grpc.StatusCode.ABORTED

    def details(self):
        return "target: the KV cache pool preempted the sequence"


def _preempting_client(preemptions: int, monkeypatch, sleep: bool = False):
    """A target client whose service preempts the next ``preemptions`` calls; it records each call's start
    position, and the waits (sleeping them only if ``sleep``)."""
    import gateway.clients as clients
    from specdec.v1 import target_service_pb2

    waits: list[float] = []
    starts: list[int] = []
    left = [preemptions]

    class Stub:
        def Verify(self, request, timeout=None):  # noqa: N802 - gRPC method name
            starts.append(request.start_position)
            if left[0] > 0:
                left[0] -= 1
                raise _Aborted()
            return target_service_pb2.VerifyResponse(num_accepted_tokens=0, recovered_token_id=7)

    real_sleep = clients.time.sleep

    def wait(seconds: float) -> None:
        waits.append(seconds)
        if sleep:
            real_sleep(seconds)

    monkeypatch.setattr(clients.time, "sleep", wait)
    client = RemoteTarget("127.0.0.1:1")
    client._stub = Stub()
    return client, left, starts, waits


def test_a_preempted_sequence_is_resent_whole_after_growing_waits(monkeypatch):
    client, left, starts, waits = _preempting_client(0, monkeypatch)
    params = SamplingParams(temperature=0)
    try:
        client.verify("s", [1, 2, 3], Proposal([]), params)
        left[0] = 7
        assert client.verify("s", [1, 2, 3, 7], Proposal([]), params).next_token_id == 7
        assert starts == [0, 3, 0, 0, 0, 0, 0, 0, 0]  # the new token, then the whole history each time
        assert waits == [0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0]  # doubling from 20 ms, at most 1 s
        assert client.verify("s", [1, 2, 3, 7, 7], Proposal([]), params).next_token_id == 7
        assert starts[-1] == 4  # held again: only what is new
    finally:
        client.close()


def test_preemption_retries_stop_at_the_deadline_and_the_next_call_sends_everything(monkeypatch):
    import time

    from specdec.errors import SequencePreemptedError

    client, left, starts, waits = _preempting_client(10**6, monkeypatch, sleep=True)
    params = SamplingParams(temperature=0)
    try:
        client.set_deadline("s", time.monotonic() + 0.5)  # room for waits of 20, 40, 80, 160 ms, not 320 more
        with pytest.raises(SequencePreemptedError):
            client.verify("s", [1, 2, 3], Proposal([]), params)
        assert waits == [0.02, 0.04, 0.08, 0.16]
        client.forget("s")
        client.preempted_retry_seconds = 0.0  # the budget of a call's resends, also when no deadline is set
        with pytest.raises(SequencePreemptedError):
            client.verify("s", [1, 2, 3], Proposal([]), params)
        assert waits == [0.02, 0.04, 0.08, 0.16] and set(starts) == {0}
    finally:
        client.close()


def test_each_call_sends_what_follows_the_history_last_sent_on_random_histories(monkeypatch):
    """What a client sends, kept incrementally, equals the whole-list rule on random rounds: each request
    starts where the history last sent successfully and the new one stop sharing ids. The histories are
    the loop's (one TokenHistory that grows; one that is cut back and regrows, as a lookahead's), equal
    plain lists, calls that fail (nothing recorded) and preempted calls (resent whole, then held) — the
    marks must never be trusted blindly."""
    import gateway.clients as clients
    from specdec.history import TokenHistory
    from specdec.v1 import target_service_pb2

    monkeypatch.setattr(clients.time, "sleep", lambda seconds: None)
    sent = []

    class Stub:
        fail = preempt = False

        def Verify(self, request, timeout=None):  # noqa: N802 - gRPC method name
            sent.append((request.start_position, list(request.new_token_ids)))
            if self.fail:
                raise _DeadlineExceeded()
            if self.preempt:
                self.preempt = False
                raise _Aborted()
            return target_service_pb2.VerifyResponse(num_accepted_tokens=0, bonus_token_id=1)

    rng = random.Random(0)
    client = RemoteTarget("127.0.0.1:1")
    stub = client._stub = Stub()
    try:
        for trial in range(20):
            sid = f"s{trial}"
            committed = TokenHistory(rng.randrange(5) for _ in range(rng.randrange(1, 30)))
            view = TokenHistory()
            held: list[int] = []  # what the service holds by the whole-list rule
            for _ in range(60):
                committed.extend(rng.randrange(5) for _ in range(rng.randrange(3)))
                pick = rng.random()
                if pick < 0.4:
                    history = committed
                elif pick < 0.8:  # the lookahead's list: cut back somewhere, then the committed ids and drafts
                    view.truncate(rng.randrange(len(view) + 1))
                    view += committed[len(view):] if committed[:len(view)] == view else []
                    view += [rng.randrange(5) for _ in range(rng.randrange(3))]
                    history = view if view else committed
                else:
                    history = list(committed) + [rng.randrange(5) for _ in range(rng.randrange(2))]
                start = shared_prefix(held, history)
                stub.fail = rng.random() < 0.15
                preempted = stub.preempt = not stub.fail and rng.random() < 0.1
                try:
                    client.verify(sid, history, Proposal([]), SamplingParams(temperature=0))
                    assert not stub.fail
                    held = list(history)
                except BackendUnavailableError:  # past the call's own deadline (the request set none)
                    assert stub.fail
                if preempted:  # that call, then the whole history again
                    assert sent[-2:] == [(start, history[start:]), (0, list(history))]
                else:
                    assert sent[-1] == (start, history[start:])
    finally:
        client.close()
