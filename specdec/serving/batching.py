"""Continuous batching: calls that arrive while a batch runs join the next batch.

Callers ``submit`` an item and block on its future. A batcher runs everything queued (up to
``max_batch_size``) as one batch and resolves each future with its own result or its own
exception, so one bad request never fails its neighbours.

Batches run on a ``ComputeThread``: by default each batcher owns one, but several batchers (a draft
and a target model in one process) can share one, taking turns batch by batch. Sharing matters on
CPUs: OpenMP (libgomp) keeps a worker pool per thread that runs parallel regions, and once a
process holds more pool threads than cores, idle workers stop spin-waiting and every parallel op
pays a futex wake-up (measured ~1.7x slower matmuls). One compute thread keeps one pool.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

_STOP = object()
# gRPC metadata a caller sets on calls it issues together: "<group id>:<number of calls in the group>"
BATCH_HINT_KEY = "specdec-batch"
# how long a batch waits at most for the rest of a hinted group (a call of it may have failed en route)
GROUP_WAIT_S = 0.05
# Decode first: a batch holding only prompts being prefilled in chunks waits (up to this long, while the
# compute thread is idle; behind other work queued there, at most MAX_PREFILL_YIELDS times) for the calls of
# sequences that are decoding, so their rows ride in the chunk's pass instead of waiting for it. The decoding
# calls arrive a hop or two after the last pass (the gateway turns a verification into the next proposal).
PREFILL_YIELD_S = 0.03
MAX_PREFILL_YIELDS = 4


def parse_batch_hint(hint: str | None) -> tuple[str, int] | None:
    """(group, size) of a batch hint; None when absent or malformed (a hint is never an error)."""
    if not hint:
        return None
    group, _, size = hint.rpartition(":")
    try:
        n = int(size)
    except ValueError:
        return None
    return (group, n) if group and n > 0 else None


class ComputeThread:
    """One OS thread running jobs in submission order (``thread_init`` runs first, on that thread)."""

    def __init__(self, name: str = "compute", thread_init: Callable[[], None] | None = None):
        self._jobs: queue.Queue = queue.Queue()
        self._thread_init = thread_init
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def idle(self) -> bool:
        """No job is waiting for this thread (the one running, if any, excepted)."""
        return self._jobs.empty()

    def close(self, timeout: float = 30) -> None:
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            self._thread.join(timeout)

    def _loop(self) -> None:
        if self._thread_init is not None:
            self._thread_init()
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            try:
                job()
            except BaseException:  # a job must never kill the thread other batchers rely on
                logger.exception("compute job failed")


class ContinuousBatcher(Generic[T, R]):
    def __init__(
        self,
        run_batch: Callable[[Sequence[T]], Sequence[R | BaseException]],
        max_batch_size: int = 16,
        name: str = "batcher",
        on_batch: Callable[[int], None] | None = None,
        on_batch_done: Callable[[list[float], float], None] | None = None,
        thread_init: Callable[[], None] | None = None,
        compute: ComputeThread | None = None,
        expected: Callable[[], int] | None = None,
        max_wait_s: float = 0.0,
        defer_to_others: bool = False,
        decoding: Callable[[], int] | None = None,
    ):
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self._on_batch = on_batch
        self._on_batch_done = on_batch_done  # (each call's queue wait, the batch's run time), in seconds
        self._queue: queue.Queue = queue.Queue()  # (item, future) waiting for a batch
        self._lock = threading.Lock()
        self._scheduled = False  # a drain job is queued on the compute thread
        self._closed = False
        # Batch window: while the compute thread has nothing else to do, a batch waits up to
        # max_wait_s for the items ``expected()`` says are on their way (sequences in a round trip
        # through the gateway), so concurrent streams stay in step and share passes. It never waits
        # when another batcher's work is queued, nor for a lone sequence.
        self._expected = expected
        self.max_wait_s = max_wait_s
        # On a shared compute thread: a batch short of what is expected lets the other batchers'
        # queued work go first (a few times at most), so the sequences that work releases can join
        # it. The draft defers to the target: streams then move in one group, draft -> target.
        self.defer_to_others = defer_to_others
        self._deferred = 0
        # How many sequences are decoding (mid round trip, their prompts fed): a batch of prefill chunks alone
        # waits for their calls (see PREFILL_YIELD_S).
        self._decoding = decoding
        self._yields = 0
        self.prefill_yields = 0  # batches of chunks that waited for decoding calls (for tests and metrics)
        self._owns_compute = compute is None
        self.compute = compute if compute is not None else ComputeThread(name, thread_init)
        self._thread = self.compute._thread

    def submit(self, item: T, hint: tuple[str, int] | None = None) -> Future:
        """Queue ``item``; ``hint`` = (group, size): the caller issues ``size`` calls of ``group`` together,
        and a batch waits until it holds them all (up to ``max(max_wait_s, GROUP_WAIT_S)``, whatever
        ``max_wait_s``: a hint is exact, and gathering its group is not the traffic guess that
        ``max_wait_s`` bounds; so batch_wait_ms=0 turns the guess off, never the hinted wait)."""
        if self._closed:
            raise RuntimeError("batcher is closed")
        fut: Future = Future()
        fut.submitted = time.monotonic()  # type: ignore[attr-defined]
        fut.hint = hint  # type: ignore[attr-defined]
        self._queue.put((item, fut))
        self._schedule()
        return fut

    def __call__(self, item: T, timeout: float | None = None, hint: tuple[str, int] | None = None) -> R:
        fut = self.submit(item, hint)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()  # still queued: it will not run (and not re-create a released sequence)
            raise

    def close(self) -> None:
        """Refuse new items, run the ones already queued, stop an owned compute thread."""
        if self._closed:
            return
        self._closed = True
        done = threading.Event()

        def finish() -> None:
            try:
                while not self._queue.empty():
                    self._drain()
            finally:
                done.set()

        if self.compute.is_alive():
            self.compute.submit(finish)
            done.wait(30)
        if self._owns_compute:
            self.compute.close()
        while True:  # anything submitted while closing: answer it rather than leave it hanging
            try:
                _, fut = self._queue.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("batcher is closed"))

    def _schedule(self) -> None:
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        self.compute.submit(self._drain)

    def _drain(self) -> None:
        """Run one batch of what is queued. Items arriving meanwhile schedule the next drain, which
        queues behind other batchers' work on a shared compute thread (they take turns)."""
        # how many items may be on their way (asked once per drain: it walks the model's sequences)
        want = 0
        if self._expected is not None and (self.defer_to_others or self.max_wait_s > 0):
            want = min(self.max_batch_size, self._expected())
        if self._should_defer(want):
            self._deferred += 1
            self.compute.submit(self._drain)  # behind the work queued now; still scheduled
            return
        self._deferred = 0
        if self._yield_to_decoding():
            self.compute.submit(self._drain)  # behind the work queued now; still scheduled
            return
        batch = []
        while len(batch) < self.max_batch_size:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if batch:  # (max_wait_s = 0: no traffic guess, but a hinted group is still gathered)
            self._linger(batch, want)
        with self._lock:
            self._scheduled = False
        if not self._queue.empty():  # a backlog past max_batch_size: its next batch takes its turn
            self._schedule()
        # a requeued call (a prompt prefilled in chunks) is running already
        live = [(item, fut) for item, fut in batch if fut.running() or fut.set_running_or_notify_cancel()]
        if live:
            self._run(live)

    def _yield_to_decoding(self) -> bool:
        """Decode first: while only prefill chunks are queued and other sequences are decoding, wait (the compute
        thread idle) for their calls, or let the work queued on the compute thread go first (True: the drain
        runs again behind it)."""
        if self._decoding is None or not self._only_prefills():
            self._yields = 0
            return False
        if self._yields >= MAX_PREFILL_YIELDS or not self._decoding():
            self._yields = 0
            return False
        self.prefill_yields += 1
        give_up = time.monotonic() + PREFILL_YIELD_S
        while self.compute.idle() and self._only_prefills() and time.monotonic() < give_up:
            time.sleep(0.0005)
        if not self.compute.idle() and self._only_prefills():
            self._yields += 1
            return True
        self._yields = 0
        return False

    def _only_prefills(self) -> bool:
        with self._queue.mutex:
            return bool(self._queue.queue) and all(getattr(fut, "prefill", False) for _, fut in self._queue.queue)

    def _should_defer(self, want: int, max_deferrals: int = 2) -> bool:
        if not self.defer_to_others or self._deferred >= max_deferrals:
            return False
        return not self.compute.idle() and self._queue.qsize() < want

    def _linger(self, batch: list, want: int) -> None:
        """Wait for the rest of the hinted groups in the batch (exact), else, while the compute thread
        is idle, for the ``want`` items expected (a guess from recent traffic)."""
        start = time.monotonic()
        while len(batch) < self.max_batch_size:
            hinted, incomplete = _group_status(batch)
            if incomplete:
                deadline = start + max(self.max_wait_s, GROUP_WAIT_S)
            elif not hinted and self.max_wait_s > 0 and len(batch) < want and self.compute.idle():
                deadline = start + self.max_wait_s
            else:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:  # short polls: stop waiting as soon as other work reaches the compute thread
                batch.append(self._queue.get(timeout=min(remaining, 0.0005)))
            except queue.Empty:
                pass

    def _run(self, batch: list[tuple[T, Future]]) -> None:
        if self._on_batch is not None:
            self._on_batch(len(batch))
        start = time.monotonic()
        try:
            results = self._run_batch([item for item, _ in batch])
        except BaseException as exc:  # the whole batch failed: every caller gets the error
            logger.exception("batch of %d failed", len(batch))
            results = [exc] * len(batch)
        if self._on_batch_done is not None:
            self._on_batch_done([start - getattr(fut, "submitted", start) for _, fut in batch],
                                time.monotonic() - start)
        requeued = False
        for (item, fut), res in zip(batch, results):
            if getattr(res, "requeue", False):  # unfinished (chunked prefill): the next batch runs it again
                fut.prefill = True  # type: ignore[attr-defined]
                self._queue.put((item, fut))
                requeued = True
            elif isinstance(res, BaseException):
                fut.set_exception(res)
            else:
                fut.set_result(res)
        if requeued:
            self._schedule()


def _group_status(batch: list) -> tuple[bool, bool]:
    """(whether any item of the batch is hinted, whether a hinted group still lacks items)."""
    sizes: dict[str, int] = {}
    counts: dict[str, int] = {}
    for _, fut in batch:
        hint = getattr(fut, "hint", None)
        if hint is not None:
            sizes[hint[0]] = hint[1]
            counts[hint[0]] = counts.get(hint[0], 0) + 1
    return bool(sizes), any(counts[g] < n for g, n in sizes.items())
