"""gateway.scheduler's stall path with scripted workers, at realistic settings (--group-stall-seconds):
a hung call holds up only its own sequence, and that sequence rejoins, intact, when the call returns."""

from __future__ import annotations

import threading
import time

from gateway.config import GatewayConfig
from gateway.scheduler import MIN_STALL_S, RoundScheduler
from specdec.proposal import Proposal, VerifyResult
from specdec.sampling import SamplingParams
from specdec.sequence import SequenceState

STALL_S = 0.3


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


class HangingTarget:
    """Verify emits token 5 + position; the calls of sequence ``hung`` wait on ``go`` (a hung backend)."""

    def __init__(self, hung: str):
        self.hung, self.go = hung, threading.Event()
        self.hanging = threading.Event()
        self.released: list[str] = []

    def verify(self, sequence_id, token_ids, proposal, params):
        if sequence_id == self.hung:
            self.hanging.set()
            assert self.go.wait(60), "the hung call was never let go"
        return VerifyResult(0, 5 + len(token_ids) % 20)

    def release(self, sequence_id):
        self.released.append(sequence_id)


def _seq(sequence_id: str, max_tokens: int) -> SequenceState:
    seq = SequenceState([1, 2], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), _Tok(),
                        frozenset(), 100)
    seq.sequence_id = sequence_id
    return seq


def _expected(max_tokens: int) -> list[int]:
    return [5 + (2 + i) % 20 for i in range(max_tokens)]


def test_the_stall_threshold_is_a_gateway_setting():
    assert GatewayConfig().group_stall_seconds == MIN_STALL_S
    scheduler = RoundScheduler(None, HangingTarget("x"), 4, min_stall_seconds=STALL_S)
    try:
        assert scheduler.stall_seconds() == STALL_S  # no step measured yet: the setting itself
    finally:
        scheduler.close()


def test_a_hung_call_stalls_only_its_own_sequence():
    target = HangingTarget("hung")
    scheduler = RoundScheduler(None, target, 4, min_stall_seconds=STALL_S)
    results: dict[str, list[int]] = {}

    def run(seq: SequenceState) -> None:
        ids: list[int] = []
        for _text, new_ids, _finished in scheduler.rounds(seq, 0):
            ids += new_ids
        results[seq.sequence_id] = ids

    try:
        hung = threading.Thread(target=run, args=(_seq("hung", 6),))
        hung.start()
        assert target.hanging.wait(30)
        began = time.monotonic()
        others = [threading.Thread(target=run, args=(_seq(f"other-{i}", 12),)) for i in range(2)]
        for t in others:
            t.start()
        for t in others:
            t.join(30)
        waited = time.monotonic() - began
        # the others ran every round while the hung call was still out (the old code waited for it forever:
        # the tests set the stall to 60 s, so this path was never taken at the real settings)
        assert not any(t.is_alive() for t in others) and hung.is_alive()
        assert waited < 20, waited
        assert results["other-0"] == results["other-1"] == _expected(12)
        target.go.set()  # the backend answers again: the hung sequence rejoins and completes, intact
        hung.join(30)
        assert not hung.is_alive() and results["hung"] == _expected(6)
        assert sorted(target.released) == ["hung", "other-0", "other-1"]
    finally:
        target.go.set()
        scheduler.close()


class PrefillingTarget(HangingTarget):
    """As HangingTarget, but only the hung sequence's FIRST call waits (its prompt's long prefill)."""

    def verify(self, sequence_id, token_ids, proposal, params):
        if sequence_id == self.hung and not self.hanging.is_set():
            self.hanging.set()
            assert self.go.wait(60), "the prefill was never let go"
        return VerifyResult(0, 5 + len(token_ids) % 20)


def test_a_decoding_sequence_never_waits_for_a_new_sequences_prefill():
    """The stall timer is out of play (60 s): the decoding sequence runs every round while the new sequence's
    first round (its prefill) is still out, counted in rounds, not timed; the new one then joins and completes."""
    target = PrefillingTarget("long")
    scheduler = RoundScheduler(None, target, 4, min_stall_seconds=60)
    decoding_rounds = []
    started = threading.Event()
    results: dict[str, list[int]] = {}

    def run(seq: SequenceState, rounds: list | None = None) -> None:
        ids: list[int] = []
        for _text, new_ids, _finished in scheduler.rounds(seq, 0):
            ids += new_ids
            if rounds is not None:
                rounds.append(target.hanging.is_set() and not target.go.is_set())
                if len(rounds) == 3:
                    started.set()
                    assert target.hanging.wait(30)
        results[seq.sequence_id] = ids

    try:
        decoding = threading.Thread(target=run, args=(_seq("decoding", 40), decoding_rounds))
        decoding.start()
        assert started.wait(30)
        long = threading.Thread(target=run, args=(_seq("long", 5),))
        long.start()
        decoding.join(30)
        assert not decoding.is_alive() and long.is_alive()
        assert decoding_rounds.count(True) == 37  # every round after the third ran while the prefill was out
        assert results["decoding"] == _expected(40)
        target.go.set()
        long.join(30)
        assert not long.is_alive() and results["long"] == _expected(5)
    finally:
        target.go.set()
        scheduler.close()
