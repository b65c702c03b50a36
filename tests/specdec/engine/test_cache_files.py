"""specdec/engine/cache_files.py: the JSON files and locks processes share under the cache."""

from __future__ import annotations

import multiprocessing
import time

from specdec.engine.cache_files import file_lock, read_json_dict, write_json_atomic


def test_json_round_trip_and_what_reads_as_empty(tmp_path):
    path = tmp_path / "sub" / "entries.json"
    assert read_json_dict(path) == {}  # missing
    write_json_atomic(path, {"b": 1, "a": [2]})
    assert read_json_dict(path) == {"a": [2], "b": 1}
    assert [p.name for p in path.parent.iterdir()] == ["entries.json"]  # no temporary file left
    path.write_text("{broken")
    assert read_json_dict(path) == {}
    path.write_text("[1, 2]")
    assert read_json_dict(path) == {}  # not an object


def _hold(path, seconds, held):
    with file_lock(path):
        held.set()
        time.sleep(seconds)


def test_the_lock_makes_another_process_wait(tmp_path):
    path = tmp_path / "x.json"
    # spawn, not fork: a test worker may hold many models' KV pools (untouched, but committed), and the kernel can
    # refuse to fork so big a process (ENOMEM, seen under the whole suite)
    ctx = multiprocessing.get_context("spawn")
    held = ctx.Event()
    other = ctx.Process(target=_hold, args=(path, 0.6, held))
    other.start()
    try:
        assert held.wait(10)
        t = time.monotonic()
        with file_lock(path):
            waited = time.monotonic() - t
    finally:
        other.join(10)
    assert waited > 0.3, waited  # it waited for the other process to let go
