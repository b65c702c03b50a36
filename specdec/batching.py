"""Continuous batching: calls that arrive while a batch runs join the next batch.

A single worker thread owns the model. Callers ``submit`` an item and block on its future; the
thread takes everything queued (up to ``max_batch_size``), runs it as one batch, and resolves each
future with its own result or its own exception, so one bad request never fails its neighbours.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

_STOP = object()


class ContinuousBatcher(Generic[T, R]):
    def __init__(
        self,
        run_batch: Callable[[Sequence[T]], Sequence[R | BaseException]],
        max_batch_size: int = 16,
        name: str = "batcher",
        on_batch: Callable[[int], None] | None = None,
    ):
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self._on_batch = on_batch
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def submit(self, item: T) -> Future:
        if self._closed:
            raise RuntimeError("batcher is closed")
        fut: Future = Future()
        self._queue.put((item, fut))
        return fut

    def __call__(self, item: T, timeout: float | None = None) -> R:
        fut = self.submit(item)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()  # still queued: it will not run (and not re-create a released sequence)
            raise

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
            self._thread.join(timeout=30)
            while True:  # anything submitted while closing: answer it rather than leave it hanging
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP and item[1].set_running_or_notify_cancel():
                    item[1].set_exception(RuntimeError("batcher is closed"))

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            batch = [first]
            stop = False
            while len(batch) < self.max_batch_size:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stop = True
                    break
                batch.append(nxt)
            live = [(item, fut) for item, fut in batch if fut.set_running_or_notify_cancel()]
            if live:
                self._run(live)
            if stop:
                return

    def _run(self, batch: list[tuple[T, Future]]) -> None:
        if self._on_batch is not None:
            self._on_batch(len(batch))
        try:
            results = self._run_batch([item for item, _ in batch])
        except BaseException as exc:  # the whole batch failed: every caller gets the error
            logger.exception("batch of %d failed", len(batch))
            results = [exc] * len(batch)
        for (_, fut), res in zip(batch, results):
            if isinstance(res, BaseException):
                fut.set_exception(res)
            else:
                fut.set_result(res)
