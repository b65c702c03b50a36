"""What keeps the gateway serving when a backend fails, and what it refuses when it is full.

- ``FallbackDraft``: the draft behind a per-call deadline and a circuit breaker. A round whose draft
  call fails, times out or is skipped (breaker open) verifies with no drafts: the target alone decides
  the round's token, so output stays identical (greedy) or identically distributed (sampled).
- ``TargetHealth``: once the target is known down, new requests get 503 at once (no retry window),
  and a probe brings service back by itself when the target answers again.
- ``Admission``: at most ``max_concurrent_requests`` sequences run and ``max_queue_len`` wait; past
  that a request is refused at once (429), and a wait longer than ``max_queue_time_seconds`` too. With
  a KV cache budget (the backends' pools), a sequence also waits while the running sequences' tokens
  and its prompt would not fit in it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable

from specdec.errors import (BackendUnavailableError, DeadlineExceededError, InvalidRequestError,
                            ResourceExhaustedError, SequencePreemptedError, SpecDecError)
from specdec.proposal import Proposal
from specdec.sampling_params import SamplingParams
from specdec.serving import metrics

logger = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
MIN_ADAPTIVE_TIMEOUT = 2.0  # seconds
ADAPTIVE_FACTOR = 5.0


class CircuitBreaker:
    """Closed: calls go through; ``failures`` consecutive failures open it. Open: calls are skipped for
    ``reset_seconds``. Half-open: one probe call goes through; its success closes the breaker, its
    failure opens it again."""

    def __init__(self, failures: int, reset_seconds: float, on_change: Callable[[str, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.failures = max(1, failures)
        self.reset_seconds = reset_seconds
        self.state = CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._probing = False
        self._lock = threading.Lock()
        self._on_change = on_change
        self._clock = clock

    def _set(self, state: str) -> None:
        if state != self.state:
            old, self.state = self.state, state
            logger.warning("draft circuit breaker: %s -> %s", old, state)
            if self._on_change is not None:
                self._on_change(old, state)

    def allow(self) -> bool:
        """May a call go through now? (In half-open, only the one probe.)"""
        with self._lock:
            if self.state == OPEN and self._clock() - self._opened_at >= self.reset_seconds:
                self._set(HALF_OPEN)
                self._probing = False
            if self.state == CLOSED:
                return True
            if self.state == HALF_OPEN and not self._probing:
                self._probing = True
                return True
            return False

    def abandon(self) -> None:
        """A call that proves nothing either way (the client's own deadline passed): the counts stay, and a
        probe in flight is given back (the next call may probe)."""
        with self._lock:
            self._probing = False

    def record(self, ok: bool) -> None:
        with self._lock:
            if ok:
                self._consecutive = 0
                self._probing = False
                self._set(CLOSED)
                return
            self._consecutive += 1
            self._probing = False
            if self.state == HALF_OPEN or self._consecutive >= self.failures:
                self._opened_at = self._clock()
                self._set(OPEN)


class FallbackDraft:
    """A draft proposer that never fails a round: it proposes nothing when the draft service cannot.

    A caller's mistake (INVALID_ARGUMENT) still fails the request: it would fail without a draft too.
    """

    def __init__(self, remote, breaker: CircuitBreaker, model_name: str, timeout: float | None = None):
        self.remote = remote
        self.breaker = breaker
        self.model_name = model_name
        self.timeout = timeout  # seconds per Propose call; None: adaptive (see call_timeout)
        self._recent: collections.deque[float] = collections.deque(maxlen=64)  # latest successful calls

    def call_timeout(self) -> float:
        """The configured deadline, or ADAPTIVE_FACTOR x the slowest of the latest successful calls (at
        least MIN_ADAPTIVE_TIMEOUT): a draft that is merely busy is waited for, a hung one is not."""
        if self.timeout is not None:
            return self.timeout
        slowest = max(self._recent, default=0.0)
        return max(MIN_ADAPTIVE_TIMEOUT, ADAPTIVE_FACTOR * slowest)

    def __getattr__(self, name: str):  # address, role, get_info, is_serving, close ... of the remote
        return getattr(self.remote, name)

    def propose(self, sequence_id: str, token_ids: list[int], num_speculative_tokens: int,
                params: SamplingParams) -> Proposal:
        if not self.breaker.allow():
            metrics.rounds_without_draft(self.model_name, "breaker_open")
            return Proposal([])
        self.remote.call_timeout = self.call_timeout()
        began = time.monotonic()
        try:
            proposal = self.remote.propose(sequence_id, token_ids, num_speculative_tokens, params)
        except InvalidRequestError:
            self.breaker.record(True)  # the draft answered; the request is wrong
            raise
        except DeadlineExceededError:
            # The client's own deadline passed (not the call's: that is a BackendUnavailableError): no sign
            # of the draft's health, and the request is over anyway.
            self.breaker.abandon()
            raise
        except SequencePreemptedError as exc:
            # The draft's KV pool is full, not failing: the draft answered (its breaker stays closed), this
            # round verifies without drafts, and the next Propose resends the sequence's whole history.
            self.breaker.record(True)
            metrics.rounds_without_draft(self.model_name, "preempted")
            logger.info("draft preempted %s (%s); this round verifies without drafts", sequence_id, exc)
            return Proposal([])
        except (SpecDecError, OSError) as exc:
            self.breaker.record(False)
            metrics.rounds_without_draft(self.model_name, "draft_failed")
            logger.info("draft failed for %s (%s); this round verifies without drafts", sequence_id, exc)
            return Proposal([])
        self.breaker.record(True)
        self._recent.append(time.monotonic() - began)
        return proposal

    def release(self, sequence_id: str) -> None:
        try:
            self.remote.release(sequence_id)
        except Exception as exc:  # noqa: BLE001 - the draft's idle expiry cleans up eventually
            logger.info("draft release of %s failed: %s", sequence_id, exc)


class SheddingDraft:
    """vLLM's ``disable_by_batch_size``: while ``running()`` sequences reach the threshold, rounds verify
    without drafts, since batched decoding then earns more than speculation."""

    def __init__(self, draft, running: Callable[[], int], threshold: int, model_name: str):
        self.draft, self.running, self.threshold, self.model_name = draft, running, threshold, model_name

    def propose(self, sequence_id: str, token_ids: list[int], num_speculative_tokens: int,
                params: SamplingParams) -> Proposal:
        if self.running() >= self.threshold:
            metrics.rounds_without_draft(self.model_name, "load")
            return Proposal([])
        return self.draft.propose(sequence_id, token_ids, num_speculative_tokens, params)

    def release(self, sequence_id: str) -> None:
        self.draft.release(sequence_id)


class TargetHealth:
    """Whether the target is known down; a probe thread marks it up again when it serves."""

    def __init__(self, target, probe_interval: float = 1.0, on_change: Callable[[bool], None] | None = None):
        self.target = target
        self.probe_interval = probe_interval
        self._on_change = on_change or (lambda up: None)
        self._down_since: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def check(self) -> None:
        """Refuse at once while the target is known down (503, with when to retry)."""
        if self._down_since is not None:
            raise BackendUnavailableError(f"the target service at {self.target.address} is unavailable; "
                                          f"retry in a few seconds")

    def mark_down(self) -> None:
        with self._lock:
            if self._down_since is not None or self._stop.is_set():
                return
            self._down_since = time.monotonic()
        logger.error("target service at %s is down: refusing new requests until it answers", self.target.address)
        self._on_change(False)
        threading.Thread(target=self._probe, name="target-probe", daemon=True).start()

    def _probe(self) -> None:
        while not self._stop.wait(self.probe_interval):
            if self.target.is_serving(timeout=min(2.0, self.probe_interval * 2)):
                with self._lock:
                    self._down_since = None
                logger.warning("target service at %s is back: serving again", self.target.address)
                self._on_change(True)
                return

    def close(self) -> None:
        self._stop.set()


class Admission:
    """Running and waiting slots for sequences (a request with n outputs takes n), and room in the KV cache.

    ``kv_budget()``: how many tokens the backends' KV cache pools hold (0: unlimited). A sequence starts
    only when the running sequences' tokens (each one's ``tokens()``, read now: they grow as they generate)
    plus its own fit in it, or when nothing runs. The pools preempt a sequence when they run out anyway;
    waiting here keeps that rare."""

    def __init__(self, max_running: int, max_waiting: int, max_queue_time: float | None,
                 kv_budget: Callable[[], int] | None = None):
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.max_queue_time = max_queue_time
        self.kv_budget = kv_budget
        self.on_refused: Callable[[str], None] = lambda reason: None  # each refusal's reason (the metrics)
        self._cond = threading.Condition()
        self.running = 0
        self.waiting = 0
        self._sizes: list[Callable[[], int]] = []  # each running sequence's tokens (those that said)
        self._queue: dict[tuple[int, int], Callable[[], int] | None] = {}  # waiting in start(): (priority, arrival)
        self._arrivals = itertools.count()

    def kv_tokens(self) -> int:
        """The running sequences' tokens now."""
        with self._cond:
            return sum(size() for size in self._sizes)

    def _kv_room(self, size: Callable[[], int] | None) -> bool:
        budget = self.kv_budget() if self.kv_budget is not None else 0
        if size is None or budget <= 0 or self.running == 0:
            return True
        return sum(s() for s in self._sizes) + size() <= budget

    def _may_start(self, ticket: tuple[int, int], size: Callable[[], int] | None) -> bool:
        """A free slot, KV room, and no sequence ahead in the queue that could start now."""
        if self.running >= self.max_running or not self._kv_room(size):
            return False
        return not any(t < ticket and self._kv_room(s) for t, s in self._queue.items())

    def reserve(self, n: int) -> None:
        """Take ``n`` places in the queue, or refuse the request at once (429)."""
        with self._cond:
            free = self.max_running - self.running
            if self.waiting + n > max(free, 0) + self.max_waiting:
                self.on_refused("queue_full")
                raise ResourceExhaustedError(
                    f"the server is at capacity ({self.running} sequences running, {self.waiting} waiting; "
                    f"--max-concurrent-requests {self.max_running}, --max-queue-len {self.max_waiting}); "
                    "retry shortly")
            self.waiting += n

    def start(self, size: Callable[[], int] | None = None, priority: int = 0) -> None:
        """Leave the queue for a running slot, waiting up to max_queue_time; a reservation must exist.
        ``size()``: the sequence's tokens (it waits for room in the KV budget too); give it to ``finish``.
        Waiting sequences start in order: the lowest ``priority`` first (0 for all under fcfs), then arrival; one
        that waits for KV room lets those behind it that fit go first."""
        with self._cond:
            deadline = None if self.max_queue_time is None else time.monotonic() + self.max_queue_time
            ticket = (priority, next(self._arrivals))
            self._queue[ticket] = size
            while not self._may_start(ticket, size):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self.waiting -= 1
                    del self._queue[ticket]
                    self._cond.notify_all()
                    if self.running < self.max_running:  # the slots were free: the KV cache was not
                        self.on_refused("kv_cache")
                        raise ResourceExhaustedError(
                            f"waited {self.max_queue_time:g} s for room in the KV cache (--max-queue-time-seconds): "
                            f"the running sequences hold {sum(s() for s in self._sizes)} of its "
                            f"{self.kv_budget()} tokens and this one needs {size()}; retry shortly, or raise "
                            "--kv-cache-memory of the services")
                    self.on_refused("queue_timeout")
                    raise ResourceExhaustedError(
                        f"waited {self.max_queue_time:g} s for a free slot (--max-queue-time-seconds); retry shortly")
                self._cond.wait(remaining)
            del self._queue[ticket]
            self._cond.notify_all()  # the next in line may fit too
            self.waiting -= 1
            self.running += 1
            if size is not None:
                self._sizes.append(size)

    def cancel(self) -> None:
        """Give back a reservation that never started."""
        with self._cond:
            self.waiting -= 1
            self._cond.notify_all()

    def finish(self, size: Callable[[], int] | None = None) -> None:
        with self._cond:
            self.running -= 1
            if size is not None:
                self._sizes.remove(size)
            self._cond.notify_all()
