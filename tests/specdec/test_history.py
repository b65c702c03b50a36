"""specdec.history: a TokenHistory's marks say exactly which leading ids are unchanged, whatever was
appended and cut in between; anything but appending and cutting back is refused."""

from __future__ import annotations

import copy
import pickle
import random

import pytest

from specdec.history import TokenHistory, common_prefix, mark_of, unchanged_prefix


def test_marks_agree_with_snapshots_under_random_appends_and_cuts(monkeypatch):
    """unchanged_since(mark) never claims more than is true, and is exact up to the first cut below it."""
    rng = random.Random(0)
    for trial in range(200):
        monkeypatch.setattr(TokenHistory, "MAX_CUTS", rng.choice([2, 4, 64]))
        h = TokenHistory(rng.randrange(4) for _ in range(rng.randrange(5)))
        marks = []  # (mark, snapshot, the shortest length since)
        for _ in range(40):
            if rng.random() < 0.35 and h:
                n = rng.randrange(len(h) + 1)
                h.truncate(n)
                marks = [(m, snap, min(low, n)) for m, snap, low in marks]
            h.extend(rng.randrange(4) for _ in range(rng.randrange(4)))
            for m, snap, low in marks:
                got = h.unchanged_since(m)
                assert got <= common_prefix(snap, h), "claims ids that changed"
                assert got in (0, min(low, len(snap))), (got, low)  # exact, or forgotten (0)
            if rng.random() < 0.5:
                marks.append((h.mark(), list(h), len(h)))


def test_only_appending_and_cutting_back_change_it():
    h = TokenHistory([1, 2, 3, 4])
    m = h.mark()
    h.append(5)
    h += [6]
    h.extend([7])
    assert h.unchanged_since(m) == 4
    del h[5:]
    assert h == [1, 2, 3, 4, 5] and h.unchanged_since(m) == 4
    assert h.pop() == 5 and h.unchanged_since(m) == 4
    del h[-1:]
    assert h == [1, 2, 3] and h.unchanged_since(m) == 3
    for edit in (lambda: h.__setitem__(0, 9), lambda: h.insert(0, 9), lambda: h.remove(1), h.sort, h.reverse,
                 lambda: h.__delitem__(0), lambda: h.__delitem__(slice(0, 1)), lambda: h.pop(0),
                 lambda: h.__imul__(2), lambda: h.__setitem__(slice(None), [1])):
        with pytest.raises(TypeError):
            edit()
    assert h == [1, 2, 3] and h.unchanged_since(m) == 3
    h.clear()
    assert h == [] and h.unchanged_since(m) == 0


def test_a_copy_with_drafts_knows_what_it_was_copied_from():
    h = TokenHistory([1, 2, 3])
    d = h + [8, 9]
    assert type(d) is TokenHistory and d == [1, 2, 3, 8, 9]
    origin, mark, n = d.origin
    assert origin is h and n == 3 and h.unchanged_since(mark) == 3
    assert type(h[:2]) is list and [0] + h == [0, 1, 2, 3]  # slices and the other way round stay plain lists
    assert copy.copy(h) == h and pickle.loads(pickle.dumps(h)) == h


def test_common_prefix_compares_only_after_what_is_known():
    rng = random.Random(1)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(8))]
        b = [rng.randrange(3) for _ in range(rng.randrange(8))]
        full = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == full
        for known in range(full + 1):
            assert common_prefix(a, b, known) == full


def test_readers_trust_only_the_object_they_marked():
    h = TokenHistory([1, 2, 3])
    source, mark = mark_of(h)
    h.append(4)
    assert unchanged_prefix(source, mark, h) == 3
    assert unchanged_prefix(source, mark, list(h)) == 0  # an equal plain list: compared in full
    assert unchanged_prefix(source, mark, TokenHistory(h)) == 0  # another history
    assert mark_of([1, 2]) == (None, None) and unchanged_prefix(None, None, h) == 0
