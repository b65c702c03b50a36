"""The Responses API's store alone (``gateway.openai.response_store``): bounded by count, bytes and age, least
recently used first; one owner's entries invisible to another; the gauges follow."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from gateway.openai.response_store import ResponseStore, StoredResponse, owner_of
from specdec.errors import ResponseNotFoundError


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def entry(rid: str, owner: str = "a", size: int = 10) -> StoredResponse:
    return StoredResponse(owner, {"id": rid, "object": "response"}, [{"type": "message", "text": "x" * size}], 1)


def gauge(name: str, model: str) -> float:
    return REGISTRY.get_sample_value(name, {"service": "gateway", "model_name": model})


def test_count_bound_drops_the_least_recently_used():
    store = ResponseStore(max_entries=3, max_bytes=10**6, ttl_seconds=None, model_name="store-count")
    for i in range(3):
        assert store.put(entry(f"r{i}"))
    store.get("a", "r0")  # r0 is now the most recently used: r1 goes first
    store.put(entry("r3"))
    with pytest.raises(ResponseNotFoundError):
        store.get("a", "r1")
    assert [store.get("a", r).response["id"] for r in ("r0", "r2", "r3")] == ["r0", "r2", "r3"]
    assert len(store) == 3 and gauge("specdec_responses_stored", "store-count") == 3
    assert REGISTRY.get_sample_value("specdec_responses_evicted_total", {
        "service": "gateway", "model_name": "store-count", "reason": "entries"}) == 1


def test_byte_bound_holds_under_many_puts_and_a_too_large_entry_is_refused():
    one = ResponseStore(1, 10**6, None).put  # measure one entry's size
    probe = entry("r0000", size=1000)
    one(probe)
    store = ResponseStore(max_entries=10**6, max_bytes=5 * probe.nbytes, ttl_seconds=None, model_name="store-bytes")
    for i in range(500):
        store.put(entry(f"r{i:04d}", size=1000))
        assert store.nbytes <= 5 * probe.nbytes
    assert len(store) == 5 and gauge("specdec_responses_stored_bytes", "store-bytes") == store.nbytes
    assert not store.put(entry("huge", size=10 * probe.nbytes))
    with pytest.raises(ResponseNotFoundError):
        store.get("a", "huge")


def test_entries_expire_unless_used():
    clock = Clock()
    store = ResponseStore(max_entries=10, max_bytes=10**6, ttl_seconds=60, clock=clock)
    store.put(entry("old"))
    store.put(entry("kept"))
    clock.now = 50
    store.get("a", "kept")  # read: its age starts again
    clock.now = 100
    with pytest.raises(ResponseNotFoundError):
        store.get("a", "old")
    assert store.get("a", "kept")
    clock.now = 200
    with pytest.raises(ResponseNotFoundError):
        store.get("a", "kept")
    assert len(store) == 0 and store.nbytes == 0


def test_another_owner_sees_a_404_like_an_unknown_id():
    store = ResponseStore(10, 10**6, None)
    store.put(entry("r", owner=owner_of("Bearer key-a")))
    with pytest.raises(ResponseNotFoundError) as info:
        store.get(owner_of("Bearer key-b"), "r", param="previous_response_id")
    assert info.value.param == "previous_response_id" and "another API key" in str(info.value)
    with pytest.raises(ResponseNotFoundError):
        store.delete(owner_of("Bearer key-b"), "r")
    assert store.get(owner_of("Bearer  key-a "), "r")  # the same key, however spaced
    store.delete(owner_of("Bearer key-a"), "r")
    assert len(store) == 0


def test_a_second_put_of_an_id_replaces_it():
    store = ResponseStore(10, 10**6, None)
    store.put(entry("r", size=10))
    store.put(entry("r", size=20))
    assert len(store) == 1 and store.nbytes == store.get("a", "r").nbytes
