"""The feature relay between a target and an EAGLE head: what it keeps, sends and asks for again."""

from __future__ import annotations

from specdec.features import FeatureChunk, FeatureRelay, default_feature_layers


def _c(start: int, rows: int) -> FeatureChunk:
    return FeatureChunk(start, rows, 4, "float32", f"rows {start}..{start + rows}")


def test_default_layers_are_vllms():
    assert default_feature_layers(30) == (2, 15, 27)
    assert default_feature_layers(32) == (2, 16, 29)


def test_relay_keeps_what_the_draft_has_not_taken():
    relay = FeatureRelay((2, 15, 27))
    assert relay.verify_from("s") == 0
    relay.put("s", _c(0, 7))
    assert relay.verify_from("s") == 7 and [c.start for c in relay.pending("s")] == [0]
    relay.acknowledge("s", 7)  # the draft took them all
    assert relay.pending("s") == []
    relay.put("s", _c(7, 2))
    relay.put("s", _c(9, 1))
    relay.acknowledge("s", 8)  # took part of the first: the chunk stays (the draft skips what it holds)
    assert [(c.start, c.rows) for c in relay.pending("s")] == [(7, 2), (9, 1)]
    relay.drop("s")
    assert relay.pending("s") == [] and relay.verify_from("s") == 0 and len(relay) == 0


def test_a_draft_that_lost_its_state_makes_the_target_compute_again():
    relay = FeatureRelay((0, 1, 2))
    relay.put("s", _c(0, 10))
    relay.acknowledge("s", 10)
    relay.put("s", _c(10, 3))
    relay.acknowledge("s", 0)  # a restarted draft holds nothing
    assert relay.pending("s") == [] and relay.verify_from("s") == 0


def test_a_gap_keeps_the_newest_chunk_only_and_rows_are_bounded():
    relay = FeatureRelay((0, 1, 2), max_rows=8)
    relay.put("s", _c(0, 5))
    relay.put("s", _c(9, 2))  # not contiguous (a target that fed again from elsewhere)
    assert [(c.start, c.rows) for c in relay.pending("s")] == [(9, 2)]
    relay.put("s", _c(11, 4))
    relay.put("s", _c(15, 4))  # 10 rows kept > 8: the oldest goes (the draft will ask for it if it lacks it)
    assert [(c.start, c.rows) for c in relay.pending("s")] == [(11, 4), (15, 4)]
