"""specdec.serving.batching.ContinuousBatcher: grouping of concurrent submissions, per-item results/errors."""

from __future__ import annotations

import threading
from concurrent import futures

import pytest

from specdec.serving.batching import ContinuousBatcher


class Recorder:
    """A run_batch that records its batches; the first batch can be held open with ``hold``."""

    def __init__(self, hold_first: bool = False, fail_items=(), raise_on=None):
        self.batches: list[list] = []
        self.sizes: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()
        self.fail_items = set(fail_items)
        self.raise_on = raise_on

    def __call__(self, items):
        self.batches.append(list(items))
        self.entered.set()
        assert self.release.wait(10)
        if self.raise_on is not None and self.raise_on in items:
            raise RuntimeError(f"whole batch failed on {self.raise_on}")
        return [ValueError(f"bad item {x}") if x in self.fail_items else x * 10 for x in items]


@pytest.fixture
def make():
    made = []

    def build(run, **kw):
        b = ContinuousBatcher(run, **kw)
        made.append(b)
        return b

    yield build
    for b in made:
        b.close()


def _queued(batcher, n):
    """Wait until n items sit in the batcher's queue."""
    import time

    give_up = time.monotonic() + 10
    while batcher._queue.qsize() < n:
        assert time.monotonic() < give_up, "items never queued"
        time.sleep(0.005)


def test_single_call_returns_its_result(make):
    rec = Recorder()
    b = make(rec, name="t")
    assert b(4) == 40 and rec.batches == [[4]]


def test_submissions_that_arrive_during_a_batch_run_together_next(make):
    rec = Recorder(hold_first=True)
    sizes = []
    b = make(rec, max_batch_size=16, on_batch=sizes.append)
    first = b.submit(0)
    assert rec.entered.wait(10)  # the worker is busy with [0]
    later = [b.submit(i) for i in range(1, 6)]
    _queued(b, 5)
    rec.release.set()
    assert first.result(10) == 0
    assert [f.result(10) for f in later] == [10, 20, 30, 40, 50]
    assert rec.batches == [[0], [1, 2, 3, 4, 5]]
    assert sizes == [1, 5]


def test_max_batch_size_splits_a_backlog_in_order(make):
    rec = Recorder(hold_first=True)
    b = make(rec, max_batch_size=2)
    b.submit(0)
    assert rec.entered.wait(10)
    futs = [b.submit(i) for i in range(1, 6)]
    _queued(b, 5)
    rec.release.set()
    assert [f.result(10) for f in futs] == [10, 20, 30, 40, 50]
    assert rec.batches == [[0], [1, 2], [3, 4], [5]]


def test_concurrent_callers_from_threads_get_their_own_results(make):
    rec = Recorder(hold_first=True)
    b = make(rec, max_batch_size=64)
    b.submit(-1)
    assert rec.entered.wait(10)
    results = {}

    def call(i):
        results[i] = b(i, timeout=10)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    _queued(b, 20)
    rec.release.set()
    for t in threads:
        t.join(10)
    assert results == {i: i * 10 for i in range(20)}
    assert len(rec.batches) == 2 and sorted(rec.batches[1]) == list(range(20))


def test_a_failing_item_fails_only_its_own_caller(make):
    rec = Recorder(hold_first=True, fail_items={2})
    b = make(rec)
    b.submit(0)
    assert rec.entered.wait(10)
    futs = {i: b.submit(i) for i in (1, 2, 3)}
    _queued(b, 3)
    rec.release.set()
    assert futs[1].result(10) == 10 and futs[3].result(10) == 30
    with pytest.raises(ValueError, match="bad item 2"):
        futs[2].result(10)
    assert rec.batches[1] == [1, 2, 3]
    assert b(7) == 70  # the worker is still alive


def test_a_batch_that_raises_fails_every_caller_of_that_batch_only(make):
    rec = Recorder(hold_first=True, raise_on=2)
    b = make(rec, max_batch_size=2)
    b.submit(0)
    assert rec.entered.wait(10)
    futs = {i: b.submit(i) for i in (1, 2, 3)}
    _queued(b, 3)
    rec.release.set()
    for i in (1, 2):
        with pytest.raises(RuntimeError, match="whole batch failed"):
            futs[i].result(10)
    assert futs[3].result(10) == 30  # the next batch is unaffected
    assert b(5) == 50


def test_cancelled_queued_item_is_skipped(make):
    rec = Recorder(hold_first=True)
    b = make(rec)
    b.submit(0)
    assert rec.entered.wait(10)
    keep, drop = b.submit(1), b.submit(2)
    _queued(b, 2)
    assert drop.cancel()
    rec.release.set()
    assert keep.result(10) == 10
    assert rec.batches == [[0], [1]]


def test_call_timeout(make):
    rec = Recorder(hold_first=True)
    b = make(rec)
    with pytest.raises(futures.TimeoutError):
        b(1, timeout=0.05)
    rec.release.set()


def test_call_whose_caller_timed_out_does_not_run(make):
    """BUG: ``__call__`` leaves the future of a caller that gave up (timeout) in the queue; the item
    still runs later (in the services: a Verify/Propose re-creating a released sequence). A caller
    that gives up should cancel its queued item, which the worker already skips."""
    rec = Recorder(hold_first=True)
    b = make(rec)
    b.submit(0)
    assert rec.entered.wait(10)
    with pytest.raises(futures.TimeoutError):
        b(1, timeout=0.05)
    rec.release.set()
    assert b(2, timeout=10) == 20
    assert all(1 not in batch for batch in rec.batches), rec.batches


def test_close_stops_the_worker_and_refuses_new_items(make):
    rec = Recorder()
    b = make(rec, name="closing")
    assert b(1) == 10
    b.close()
    assert not b._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        b.submit(2)
    b.close()  # idempotent


def test_close_finishes_items_queued_before_it(make):
    rec = Recorder(hold_first=True)
    b = make(rec)
    first = b.submit(0)
    assert rec.entered.wait(10)
    queued = b.submit(1)
    _queued(b, 1)
    closer = threading.Thread(target=b.close)
    closer.start()
    rec.release.set()
    closer.join(10)
    assert first.result(10) == 0 and queued.result(10) == 10


# -- shared compute thread, batch window, deferral --------------------------------------------------


class Blocker:
    """A job that holds the compute thread until released, so that work queues up behind it."""

    def __init__(self, compute):
        self.entered, self.release = threading.Event(), threading.Event()
        compute.submit(self._job)
        assert self.entered.wait(10)

    def _job(self):
        self.entered.set()
        assert self.release.wait(10)


@pytest.fixture
def compute():
    from specdec.serving.batching import ComputeThread

    c = ComputeThread("test-compute")
    yield c
    c.close()


def test_batchers_sharing_a_compute_thread_run_on_that_one_thread(make, compute):
    seen = []

    def run(items):
        seen.append(threading.get_ident())
        return [x * 10 for x in items]

    a = make(run, compute=compute)
    b = make(run, compute=compute)
    assert a(1) == 10 and b(2) == 20 and a(3) == 30
    assert len(set(seen)) == 1 and seen[0] == compute._thread.ident
    a.close()
    assert compute.is_alive()  # a batcher never stops a compute thread it does not own
    assert b(4) == 40


def test_idle_batch_waits_for_expected_items_mid_round_trip(make):
    rec = Recorder()
    b = make(rec, expected=lambda: 3, max_wait_s=30.0)
    first = b.submit(1)

    def later():
        import time

        time.sleep(0.05)
        b.submit(2)
        b.submit(3)

    threading.Thread(target=later).start()
    assert first.result(10) == 10
    assert rec.batches == [[1, 2, 3]]


def test_a_lone_sequence_never_waits(make):
    rec = Recorder()
    b = make(rec, expected=lambda: 1, max_wait_s=30.0)
    assert b.submit(1).result(5) == 10  # a 30 s window would time this out


def test_batch_window_ends_when_other_work_reaches_the_compute_thread(make, compute):
    rec_a, rec_b = Recorder(), Recorder()
    a = make(rec_a, compute=compute, expected=lambda: 5, max_wait_s=30.0)
    b = make(rec_b, compute=compute)
    fa = a.submit(1)
    assert rec_a.batches == [] and not fa.done()  # lingering for the 4 it expects
    fb = b.submit(2)
    assert fa.result(5) == 10 and fb.result(5) == 20
    assert rec_a.batches == [[1]]


def test_a_deferring_batcher_lets_queued_work_go_first_and_gathers_what_it_releases(make, compute):
    """The draft defers to the target: a stream released by the target's batch joins the draft's."""
    order = []
    draft = None

    def run_target(items):
        order.append(("target", list(items)))
        draft.submit("d2")  # the verified stream comes straight back for its next proposal
        return items

    def run_draft(items):
        order.append(("draft", list(items)))
        return items

    draft = make(run_draft, compute=compute, expected=lambda: 2, max_wait_s=5.0, defer_to_others=True)
    target = make(run_target, compute=compute)
    blocker = Blocker(compute)
    d1 = draft.submit("d1")
    t1 = target.submit("t1")
    blocker.release.set()
    assert d1.result(10) == "d1" and t1.result(10) == "t1"
    assert order == [("target", ["t1"]), ("draft", ["d1", "d2"])]


def test_deferral_is_bounded(make, compute):
    """A batcher defers a few times at most: other work that keeps coming cannot starve it."""
    rec = Recorder()
    draft = make(rec, compute=compute, expected=lambda: 100, max_wait_s=0.0, defer_to_others=True)
    busy = threading.Event()

    def keep_busy():
        if not busy.is_set():
            compute.submit(keep_busy)

    blocker = Blocker(compute)
    fut = draft.submit(1)
    compute.submit(keep_busy)
    blocker.release.set()
    try:
        assert fut.result(10) == 10
    finally:
        busy.set()


@pytest.mark.parametrize("max_wait_s", [0.001, 0.0])  # batch_wait_ms=0 turns the traffic guess off, not hints
def test_a_hinted_group_runs_as_one_batch_however_its_calls_trickle_in(make, monkeypatch, max_wait_s):
    from specdec.serving import batching

    monkeypatch.setattr(batching, "GROUP_WAIT_S", 30.0)
    rec = Recorder()
    b = make(rec, expected=lambda: 1, max_wait_s=max_wait_s)  # no traffic guess: only the hint keeps the batch open
    first = b.submit(1, hint=("g1", 3))
    ran_early = []

    def later():
        for x in (2, 3):
            ran_early.append(rec.entered.wait(0.02))  # no batch has run: it still waits for the group
            b.submit(x, hint=("g1", 3))

    t = threading.Thread(target=later)
    t.start()
    assert first.result(10) == 10
    t.join()
    assert ran_early == [False, False]
    assert rec.batches == [[1, 2, 3]]


def test_a_complete_hinted_group_runs_at_once_and_an_incomplete_one_is_not_waited_for_forever(make, monkeypatch):
    from specdec.serving import batching

    rec = Recorder()
    b = make(rec, expected=lambda: 50, max_wait_s=30.0)  # the traffic guess would wait: a complete hint does not
    assert b.submit(1, hint=("a", 1)).result(5) == 10
    monkeypatch.setattr(batching, "GROUP_WAIT_S", 0.05)
    b.max_wait_s = 0.001
    assert b.submit(2, hint=("b", 2)).result(5) == 20  # its partner never comes (a call failed en route)
    assert rec.batches == [[1], [2]]


@pytest.mark.parametrize("hint, parsed", [("abc-1:3", ("abc-1", 3)), ("a:b:2", ("a:b", 2)), (None, None), ("", None),
                                          ("g:0", None), ("g:x", None), (":3", None), ("nocolon", None)])
def test_batch_hints_parse_or_are_ignored(hint, parsed):
    from specdec.serving.batching import parse_batch_hint

    assert parse_batch_hint(hint) == parsed


def test_batch_wait_zero_never_guesses(make):
    """max_wait_s = 0 (batch_wait_ms=0): an unhinted batch runs what is queued, however many sequences
    recent traffic expects (with a wait of 30 s, the same batch would wait for them)."""
    rec = Recorder()
    b = make(rec, expected=lambda: 8, max_wait_s=0.0)
    assert b.submit(1).result(5) == 10
    assert b.submit(2).result(5) == 20
    assert rec.batches == [[1], [2]]


class Chunked:
    """A run_batch where item "prompt" needs ``chunks`` passes (UNFINISHED-style requeue until then); after each
    prompt-only pass, ``after_pass`` runs (a decoding sequence's call arriving a hop later)."""

    class _Requeue:
        requeue = True

    def __init__(self, chunks: int, after_pass=None):
        self.left, self.batches, self.after_pass = chunks, [], after_pass

    def __call__(self, items):
        import time

        self.batches.append(sorted(items))
        time.sleep(0.02)  # a chunk's pass
        out = []
        for x in items:
            if x == "prompt":
                self.left -= 1
                out.append(self._Requeue() if self.left else "prefilled")
            else:
                out.append(x)
        if items == ["prompt"] and self.after_pass is not None:
            self.after_pass()
        return out


@pytest.mark.parametrize("decoding", [1, 0])
def test_prefill_chunks_wait_for_decoding_calls_to_ride_with_them(make, decoding):
    """Decode first: a decoding call that arrives a few ms after a chunk's pass runs in the next pass, beside the
    next chunk, instead of waiting for a chunk-only pass (with nothing decoding, chunks run back to back)."""
    import time

    arrivals = []

    def decode_call_soon():
        if len(arrivals) < 3:
            name = f"decode-{len(arrivals) + 1}"
            arrivals.append(threading.Timer(0.005, lambda: (run.batches.append(f"{name} arrives"), b.submit(name))))
            arrivals[-1].start()

    run = Chunked(6, after_pass=decode_call_soon if decoding else None)
    b = make(run, decoding=lambda: decoding)
    assert b.submit("prompt").result(30) == "prefilled"
    if decoding:
        time.sleep(0.1)
        # every decoding call ran in the pass right after it arrived, beside a chunk (no chunk-only pass began
        # while it was on its way: it never waited for one)
        for i in (1, 2, 3):
            at = run.batches.index(f"decode-{i} arrives")
            assert run.batches[at - 1] == ["prompt"] and run.batches[at + 1] == [f"decode-{i}", "prompt"]
        assert b.prefill_yields >= 3
    else:
        assert run.batches == [["prompt"]] * 6 and b.prefill_yields == 0
