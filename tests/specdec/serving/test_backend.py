"""specdec.serving.backend: ``Backend.history`` keeps each sequence's history in one list and still
returns exactly the held prefix [0, start_position) + the new ids, whatever the workers did to what they
hold (no model: a scripted runner)."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

import pytest

from specdec.drafting_state import DraftingState
from specdec.errors import SequenceNotFoundError
from specdec.ngram import NgramIndex
from specdec.serving.backend import Backend, BackendConfig


@dataclass
class _Seq:
    tokens: list[int] = field(default_factory=list)  # what the worker holds (a model runner's KV tokens)
    state: DraftingState = field(default_factory=DraftingState)
    last_used: float = 0.0


class _Runner:
    def __init__(self):
        self.lock = threading.RLock()
        self.sequences: dict[str, _Seq] = {}


def _model_worker(rng: random.Random, seq: _Seq, history: list[int]) -> None:
    """What a model runner does with a call: keep the common prefix (at most all but the last id), feed the
    rest, then keep drafts (a draft) or accepted drafts (a target) after it."""
    n = min(len(seq.tokens), len(history) - 1)
    while n and seq.tokens[:n] != history[:n]:
        n -= 1
    del seq.tokens[n:]
    seq.tokens += history[n:]
    seq.tokens += [rng.randrange(5) for _ in range(rng.randrange(3))]


def _lookup_worker(rng: random.Random, seq: _Seq, history: list[int]) -> None:
    """What a hybrid draft does: its n-gram index follows the history and is what the service holds."""
    if seq.state.lookup_index is None:
        seq.state.lookup_index = NgramIndex(1, 2)
    seq.state.lookup_index.sync(history)
    seq.state.held_target_ids = seq.state.lookup_index.tokens


@pytest.mark.parametrize("worker", [_model_worker, _lookup_worker], ids=["model", "lookup"])
@pytest.mark.parametrize("seed", range(3))
def test_history_equals_the_held_prefix_and_the_new_ids(worker, seed):
    """Random rounds (the gateway's usual starts, arbitrary ones, resends from 0, calls the worker never
    ran (a deadline), a later call reaching the worker first, evictions): each call returns
    held[:start] + new as computed from the held ids right then, or NOT_FOUND exactly when that is
    impossible; and a sequence keeps one list."""
    rng = random.Random(seed)
    backend = Backend("draft", BackendConfig(model="scripted"))
    backend.runner = _Runner()
    sid = "s"
    sent: list[int] = []  # what the gateway last sent successfully
    pending: list[tuple[_Seq, list[int]]] = []  # calls the worker has not run yet
    first_list: list[tuple[_Seq, list[int]]] = []  # per sequence (evictions make new ones): its list
    for _ in range(400):
        seq = backend.runner.sequences.get(sid)
        held = [] if seq is None else seq.tokens if seq.state.held_target_ids is None else seq.state.held_target_ids
        history = sent[: rng.randrange(len(sent) + 1)] if rng.random() < 0.2 else list(sent)
        history += [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
        pick = rng.random()
        start = (0 if pick < 0.1 else rng.randrange(len(held) + 2) if pick < 0.3
                 else next((i for i, (a, b) in enumerate(zip(sent, history)) if a != b), min(len(sent), len(history))))
        want = None if start and (seq is None or len(held) < start) else list(held[:start]) + history[start:]
        try:
            got = backend.history(sid, start, history[start:])
        except SequenceNotFoundError:
            assert want is None
            continue
        assert want is not None and got == want
        if seq is not None:
            if not first_list or first_list[-1][0] is not seq:
                first_list.append((seq, got))
            assert got is first_list[-1][1], "a sequence keeps one list"
        else:  # the first call creates the sequence
            seq = backend.runner.sequences[sid] = _Seq()
        pending.append((seq, got))
        fate = rng.random()
        if fate < 0.1:  # the deadline passed before the worker ran it: never runs, the gateway keeps `sent`
            pending.pop()
            continue
        if fate < 0.2 and len(pending) == 1:  # still queued: the next call's history comes first
            continue
        for s, h in pending:  # (a later call's list may be the same list, now with its ids: run with those)
            worker(rng, s, h)
        pending.clear()
        sent = list(got)
        if rng.random() < 0.03:  # evicted: the next call gets NOT_FOUND and resends
            backend.runner.sequences.pop(sid)
            sent = []
    assert first_list
