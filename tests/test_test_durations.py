"""The suite's own machinery: scripts/test_durations.py reads a pytest-reportlog file and names what grew past its
budget; tests/conftest.py runs files longest first and keeps each file's tests together and in order."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

import tests.conftest as suite

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def durations():
    spec = importlib.util.spec_from_file_location("test_durations", ROOT / "scripts" / "test_durations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report(path: Path, rows: list[tuple[str, str, float, list[str]]]) -> Path:
    lines = [json.dumps({"$report_type": "SessionStart", "pytest_version": "9"})]
    for nodeid, when, seconds, markers in rows:
        lines.append(json.dumps({"$report_type": "TestReport", "nodeid": nodeid, "when": when, "outcome": "passed",
                                 "duration": seconds, "keywords": {m: 1 for m in markers}}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_report_adds_up_per_file_and_per_test(durations, tmp_path):
    report = _report(tmp_path / "r.jsonl", [
        ("tests/a.py::test_x", "setup", 2.0, []), ("tests/a.py::test_x", "call", 1.0, []),
        ("tests/a.py::test_x", "teardown", 0.5, []), ("tests/b.py::test_y", "call", 9.0, ["heavy"]),
        ("tests/b.py::test_z", "call", 6.0, [])])
    files, tests, outcomes, inner = durations.read_report(report)
    assert files == {"tests/a.py": 3.5, "tests/b.py": 15.0}
    assert tests["tests/a.py::test_x"] == 3.5 and outcomes["tests/b.py::test_y"] == "passed"
    assert inner == {"tests/a.py::test_x": 1.0, "tests/b.py::test_z": 6.0}  # heavy is not the inner loop


def test_check_names_slow_inner_loop_tests_grown_files_and_new_files(durations, tmp_path, monkeypatch):
    recorded = tmp_path / "durations.json"
    recorded.write_text(json.dumps({"files": {"tests/a.py": 10.0, "tests/b.py": 10.0}}))
    monkeypatch.setattr(durations, "DURATIONS", recorded)
    lines = durations.check({"tests/a.py": 12.0, "tests/b.py": 45.0, "tests/c.py": 1.0},
                            {"tests/b.py::test_long": 70.0}, {"tests/a.py::test_x": 6.0, "tests/a.py::test_y": 1.0})
    text = "\n".join(lines)
    assert "tests/b.py::test_long took 70.0 s" in text  # over the per-test budget
    assert "mark it heavy" in text and "tests/a.py::test_x" in text and "test_y" not in text
    assert "file grew: tests/b.py" in text and "tests/a.py took" not in text  # 12 s of 10 is noise
    assert "not in tests/durations.json: tests/c.py" in text


def test_writing_the_record_sorts_files_longest_first(durations, tmp_path, monkeypatch):
    monkeypatch.setattr(durations, "DURATIONS", tmp_path / "durations.json")
    data = durations.write({"tests/a.py": 1.0, "tests/b.py": 3.0}, {"tests/b.py::t": 3.0}, "a note")
    assert list(data["files"]) == ["tests/b.py", "tests/a.py"] and data["note"] == "a note"
    assert json.loads((tmp_path / "durations.json").read_text()) == data
    assert re.fullmatch(r".+; .+", data["machine"]), data["machine"]  # the CPU, then its vector flags


def test_merging_a_partial_run_replaces_its_files_and_keeps_the_others(durations):
    old = {"files": {"tests/a.py": 50.0, "tests/b.py": 9.0}, "note": "whole run",
           "slowest_tests": {"tests/a.py::t": 50.0, "tests/b.py::u": 9.0}}
    files, tests, note = durations.merged(old, {"tests/b.py": 2.0, "tests/c.py": 4.0}, {"tests/c.py::v": 4.0}, "")
    assert files == {"tests/a.py": 50.0, "tests/b.py": 2.0, "tests/c.py": 4.0}
    assert tests == {"tests/a.py::t": 50.0, "tests/c.py::v": 4.0} and note == "whole run"


class _Item:
    def __init__(self, nodeid: str):
        self.nodeid = nodeid


def test_files_run_longest_first_with_their_tests_together_and_in_order(tmp_path, monkeypatch):
    recorded = tmp_path / "durations.json"
    recorded.write_text(json.dumps({"files": {"tests/short.py": 1.0, "tests/long.py": 100.0}}))
    monkeypatch.setattr(suite, "DURATIONS", recorded)
    items = [_Item(n) for n in ("tests/short.py::a", "tests/short.py::b", "tests/new.py::x", "tests/long.py::c",
                                "tests/long.py::d[1]", "tests/long.py::d[2]")]
    suite.order_by_recorded_duration(items)
    # long (100 s), then the unknown file as a mid-sized one (UNKNOWN_FILE_SECONDS), then short (1 s)
    assert [i.nodeid for i in items] == ["tests/long.py::c", "tests/long.py::d[1]", "tests/long.py::d[2]",
                                         "tests/new.py::x", "tests/short.py::a", "tests/short.py::b"]


def test_the_committed_record_lists_every_test_file():
    recorded = json.loads((ROOT / "tests" / "durations.json").read_text())["files"]
    on_disk = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    missing = sorted(on_disk - set(recorded))
    assert not missing, f"record these in tests/durations.json (scripts/test_durations.py REPORT --merge): {missing}"
