"""Group scheduling: the gateway steps all live sequences' rounds together.

One independent loop per request lets concurrent streams fall out of step: while some verify, others
propose, and each service runs several small batches where one would do. ``RoundScheduler`` runs
one loop for every live sequence instead (vLLM-style scheduling): each step issues every sequence's
Propose at once, waits for them, then every Verify at once (``specdec.decoding.group_round``), and
each call carries a batch hint (``specdec-batch: <group>:<size>`` metadata, see
``specdec.serving.batching``) so the service runs the whole phase as one batch instead of guessing
with a timer. Sequences join at the next step and leave when they finish, fail or are cancelled;
each request still streams its tokens as soon as its round is verified. With overlap, a step's
lookahead Proposes (``specdec.decoding.Lookahead``) run as a batched phase of their own beside its
Verify phase.

A new sequence's first round (its prompt's prefill on both services, which may take many passes) runs as
a step of its own, beside the group's: the decoding sequences keep stepping while it prefills, and it joins
them at the first step boundary after its first round. (The services interleave its prefill chunks with
the decoding sequences' rows: ``specdec.engine.scheduler``.)

A slow consumer never stalls the group (its rounds queue up for it), nor does a cancelled one (it
is dropped at the next step), nor a call that hangs: once a step has run for several times the usual
step time, the ready sequences step without it, and it rejoins them at a step boundary when its call
returns. A sequence whose call fails leaves the group with its error.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from gateway.clients import batch_hint
from specdec.decoding import Lookahead, group_round, k_of
from specdec.errors import BackendUnavailableError
from specdec.sequence import SequenceState

logger = logging.getLogger(__name__)

_CANCELLED = object()  # handed to a member whose client went away
# A step in flight for longer than STALL_FACTOR x the median recent step (and at least min_stall_seconds,
# --group-stall-seconds, MIN_STALL_S by default) has stalled (a hung call, a long prefill): the ready
# members then run a step of their own.
MIN_STALL_S = 1.0
STALL_FACTOR = 4.0
STALL_POLL_S = 0.1


class _Member:
    def __init__(self, seq: SequenceState, k: int, cancelled: Callable[[], bool] | None, overlap: bool):
        self.seq, self.k = seq, k
        self.ahead = Lookahead() if overlap else None  # the next round's proposal, drafted during a verify
        self.cancelled = cancelled or (lambda: False)
        self.rounds: queue.Queue = queue.Queue()  # each step's (text, token ids, finished), an exception, or _CANCELLED
        self.active = True  # still stepped: not finished, failed, cancelled or left
        self.seen = 0  # output tokens already handed out
        self.fresh = True  # its first round (the prompt's prefill) has not run: it steps apart from the group


class RoundScheduler:
    """Drives the rounds of every sequence that joins, one step of the whole group at a time."""

    def __init__(self, draft, target, max_concurrent_calls: int, hints: bool = True, overlap: bool = False,
                 min_stall_seconds: float = MIN_STALL_S):
        self.draft, self.target = draft, target
        self.min_stall_seconds = min_stall_seconds  # --group-stall-seconds
        self.hints = hints  # batch hints are exact only when every call of a phase goes to one service
        self.overlap = overlap  # each step also drafts the next round ahead, beside the verifications
        self._members: list[_Member] = []
        # id of each member a step in flight holds -> (when that step began, whether it is a step of fresh members)
        self._in_step: dict[int, tuple[float, bool]] = {}
        self._durations: collections.deque[float] = collections.deque(maxlen=32)  # recent steps' run times
        self._cond = threading.Condition()
        self._closed = False
        self._groups = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]  # group ids differ between gateways sharing a service
        # a step's calls (with overlap, the verifications and lookaheads of a step: twice as many), and the
        # steps themselves (more than one only while a step has stalled)
        self._pool = ThreadPoolExecutor(2 * max(1, max_concurrent_calls), thread_name_prefix="round-call")
        self._steps = ThreadPoolExecutor(max(2, max_concurrent_calls), thread_name_prefix="round-step")
        self.steps = 0  # steps run (for tests and logs)
        self._thread = threading.Thread(target=self._loop, name="round-scheduler", daemon=True)
        self._thread.start()

    def rounds(self, seq: SequenceState, k: int | Callable[[SequenceState], int],
               cancelled: Callable[[], bool] | None = None) -> Iterator[tuple[str, list[int], bool]]:
        """The sequence's rounds as the group runs them: each round's (new text, new token ids, finished).
        As with ``decode``, closing the iterator, an error or ``cancelled()`` (checked every step) ends
        it and releases both services' caches."""
        member = _Member(seq, k, cancelled, self.overlap)
        with self._cond:
            if self._closed:
                raise RuntimeError("the gateway is closing")
            self._members.append(member)
            self._cond.notify_all()
        try:
            finished = False
            while not finished:
                item = member.rounds.get()
                if item is _CANCELLED:
                    return
                if isinstance(item, BaseException):
                    raise item
                finished = item[2]
                yield item
        finally:
            self._leave(member)

    def _leave(self, member: _Member) -> None:
        with self._cond:
            member.active = False
            while id(member) in self._in_step:  # its calls are in flight: let the step end first
                self._cond.wait()
            self._members.remove(member)
        member.seq.abort()
        for client in (self.target, self.draft):
            if client is not None:
                client.release(member.seq.sequence_id)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._may_step():
                    self._cond.wait(STALL_POLL_S if self._in_step else None)
                if self._closed:
                    return
                groups: dict[bool, list[_Member]] = {True: [], False: []}  # fresh -> ready members
                decoding_may_step = self._decoding_may_step()
                for m in self._members:
                    if not m.active or id(m) in self._in_step or not (m.fresh or decoding_may_step):
                        continue
                    if m.cancelled():
                        m.active = False
                        m.rounds.put(_CANCELLED)
                    else:
                        groups[m.fresh].append(m)
                started = time.monotonic()
                for fresh, group in groups.items():
                    self._in_step.update((id(m), (started, fresh)) for m in group)
            for fresh, group in groups.items():
                if group:
                    self._steps.submit(self._run_step, group, started, fresh)

    def _may_step(self) -> bool:
        """A step may start: a fresh member is ready (a prefill never waits for the group, nor the group for
        it), or a decoding member is ready and ``_decoding_may_step``."""
        ready = [m for m in self._members if m.active and id(m) not in self._in_step]
        return any(m.fresh for m in ready) or (any(not m.fresh for m in ready) and self._decoding_may_step())

    def _decoding_may_step(self) -> bool:
        """No decoding step is in flight, or the oldest one has stalled (a hung call must not hold up everyone
        else: the ready members go ahead and rejoin the stalled ones at a later step boundary). Steps of fresh
        members (prefills) never hold the decoding ones up."""
        decoding = [t for t, fresh in self._in_step.values() if not fresh]
        return not decoding or time.monotonic() - min(decoding) > self.stall_seconds()

    def stall_seconds(self) -> float:
        """How long a step may run before the ready members start one of their own."""
        recent = sorted(self._durations)
        floor = self.min_stall_seconds
        return max(floor, STALL_FACTOR * recent[len(recent) // 2]) if recent else floor

    def _run_step(self, group: list[_Member], started: float, fresh: bool = False) -> None:
        try:
            self._step(group)
        finally:
            with self._cond:
                if not fresh:  # the stall timer reads the decoding steps' times (a prefill's is no guide)
                    self._durations.append(time.monotonic() - started)
                for m in group:
                    m.fresh = False
                    self._in_step.pop(id(m), None)
                self._cond.notify_all()

    def _step(self, group: list[_Member]) -> None:
        if not group:
            return
        self.steps += 1
        try:
            outcomes = group_round(self.draft, self.target, [m.seq for m in group], [k_of(m.k, m.seq) for m in group],
                                   self._run_all, [m.ahead for m in group])
        except BaseException as exc:  # noqa: BLE001 - a bug here must fail the requests, not hang them
            logger.exception("a round of %d sequences failed", len(group))
            outcomes = [exc] * len(group)
        for member, outcome in zip(group, outcomes):
            seq = member.seq
            if isinstance(outcome, BaseException) or seq.finished:
                member.active = False
            if isinstance(outcome, BaseException):
                member.rounds.put(outcome)
                continue
            member.rounds.put((outcome, seq.output_token_ids[member.seen:], seq.finished))
            member.seen = len(seq.output_token_ids)

    def _run_all(self, *phases: Sequence[Callable[[], object]]) -> list[list]:
        """Issue phases of calls, all at once (each call on a pool thread, with its phase's batch hint); wait
        for all. Returns each phase's results in order (a call's exception in place of its result)."""
        tasks = []
        for calls in phases:
            hint = f"{self._prefix}-{next(self._groups)}:{len(calls)}" if self.hints and calls else None
            tasks += [(call, hint) for call in calls]

        def run(task: tuple[Callable[[], object], str | None]):
            call, hint = task
            with batch_hint(hint):
                try:
                    return call()
                except BaseException as exc:  # noqa: BLE001 - handed to its own sequence
                    return exc

        # a lone call runs here: no hand-off to a pool thread
        results = [run(tasks[0])] if len(tasks) == 1 else list(self._pool.map(run, tasks))
        out, start = [], 0
        for calls in phases:
            out.append(results[start:start + len(calls)])
            start += len(calls)
        return out

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for m in self._members:  # nobody steps them any more: tell their requests
                if m.active:
                    m.active = False
                    m.rounds.put(BackendUnavailableError("the gateway is shutting down; retry"))
            self._cond.notify_all()
        self._thread.join(30)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._steps.shutdown(wait=False, cancel_futures=True)
