#!/usr/bin/env python
"""Recorded test durations: tests/durations.json, refreshed from a pytest-reportlog file.

    python -m pytest tests -p no:xdist --report-log=/tmp/report.jsonl   # one serial run (real seconds per file)
    python scripts/test_durations.py /tmp/report.jsonl                  # rewrite tests/durations.json, print the top
    python scripts/test_durations.py /tmp/report.jsonl --check          # compare a run with the recorded file only
    python scripts/test_durations.py /tmp/new.jsonl --merge             # a run of a few files: update just those

tests/conftest.py schedules files longest first by these numbers (pytest-xdist's ``--dist loadfile`` then keeps
both workers busy to the end), and a file or test that grew past its budget shows up in review as a changed number.
``scripts/test.sh`` writes the report of each run to ``.pytest_cache/report.jsonl`` and runs ``--check`` on it.
A file's seconds are the sum of its tests' set-up, call and tear-down (module-scoped servers included).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DURATIONS = ROOT / "tests" / "durations.json"
TEST_BUDGET_S = 60.0  # one test (set-up, call, tear-down) over this is listed as over budget
HEAVY_CALL_S = 5.0  # a test whose call takes longer belongs out of the inner loop: marked heavy (or slow)
GROWTH = 1.5  # --check: a file that took this much longer than recorded (and 20 s more) is listed
GROWTH_SLACK_S = 20.0


def read_report(path: Path) -> tuple[dict[str, float], dict[str, float], dict[str, str], dict[str, float]]:
    """(seconds per file, seconds per test, outcome per test, call seconds of each test that is in the inner loop:
    not marked slow, heavy or cuda) from a pytest-reportlog JSONL file."""
    files: dict[str, float] = defaultdict(float)
    tests: dict[str, float] = defaultdict(float)
    outcomes: dict[str, str] = {}
    inner_calls: dict[str, float] = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if entry.get("$report_type") != "TestReport":
            continue
        nodeid, seconds = entry["nodeid"], float(entry["duration"])
        files[nodeid.split("::", 1)[0]] += seconds
        tests[nodeid] += seconds
        if entry["when"] == "call" or entry["outcome"] != "passed":
            outcomes[nodeid] = entry["outcome"]
        if entry["when"] == "call" and not {"slow", "heavy", "cuda"} & set(entry.get("keywords", {})):
            inner_calls[nodeid] = seconds
    return dict(files), dict(tests), outcomes, inner_calls


def cpu_flags() -> str:
    """The CPU model and its vector extensions (avx2/avx512*/amx*), for the numbers' machine."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    model = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", info, re.M)
    wanted = sorted({f for f in (flags.group(1).split() if flags else []) if re.match(r"(avx2|avx512|amx)", f)})
    return f"{model.group(1).strip() if model else platform.machine()}; {' '.join(wanted) or 'no avx2'}"


def write(files: dict[str, float], tests: dict[str, float], note: str) -> dict:
    data = {
        "about": "Seconds per test file (set-up + call + tear-down) of the run the note names; tests/conftest.py runs "
                 "files longest first. Refresh: scripts/test_durations.py (its docstring).",
        "machine": cpu_flags(),
        "note": note,
        "total_seconds": round(sum(files.values()), 1),
        "files": {path: round(s, 1) for path, s in sorted(files.items(), key=lambda kv: (-kv[1], kv[0]))},
        "slowest_tests": {nodeid: round(s, 1) for nodeid, s in sorted(tests.items(), key=lambda kv: -kv[1])[:25]
                          if s >= 1.0},
    }
    DURATIONS.write_text(json.dumps(data, indent=1) + "\n")
    return data


def merged(old: dict, files: dict[str, float], tests: dict[str, float], note: str):
    """The recorded files and slowest tests with this partial run's files replaced (and added)."""
    kept = {k: v for k, v in old.get("slowest_tests", {}).items() if k.split("::", 1)[0] not in files}
    return {**old["files"], **files}, {**kept, **tests}, note or old.get("note", "")


def check(files: dict[str, float], tests: dict[str, float], inner_calls: dict[str, float]) -> list[str]:
    """Lines naming what grew past its budget: a test over TEST_BUDGET_S, an inner-loop test whose call took over
    HEAVY_CALL_S, a file well over its recorded time or not recorded yet."""
    try:
        recorded = json.loads(DURATIONS.read_text())["files"]
    except (OSError, ValueError, KeyError):
        recorded = {}
    lines = [f"test over its {TEST_BUDGET_S:.0f} s budget: {nodeid} took {s:.1f} s"
             for nodeid, s in sorted(tests.items(), key=lambda kv: -kv[1]) if s > TEST_BUDGET_S]
    lines += [f"inner-loop test took {s:.1f} s (over {HEAVY_CALL_S:.0f} s): mark it heavy, or make it faster: {nodeid}"
              for nodeid, s in sorted(inner_calls.items(), key=lambda kv: -kv[1]) if s > HEAVY_CALL_S]
    for path, s in sorted(files.items(), key=lambda kv: -kv[1]):
        was = recorded.get(path)
        if was is None:
            lines.append(f"file not in tests/durations.json: {path} ({s:.1f} s)")
        elif s > GROWTH * was and s > was + GROWTH_SLACK_S:
            lines.append(f"file grew: {path} took {s:.1f} s, recorded {was:.1f} s")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="a pytest-reportlog JSONL file (pytest --report-log=PATH)")
    parser.add_argument("--check", action="store_true", help="compare with tests/durations.json; write nothing")
    parser.add_argument("--merge", action="store_true",
                        help="keep the recorded files this report does not have (a run of a new or changed file)")
    parser.add_argument("--note", default="", help="how the run was made (command, workers), kept in the file")
    parser.add_argument("--top", type=int, default=20, help="how many of the slowest files and tests to print")
    args = parser.parse_args(argv)
    files, tests, outcomes, inner_calls = read_report(args.report)
    if not files:
        print(f"{args.report}: no test reports in it", file=sys.stderr)
        return 2
    if args.check:
        for line in check(files, tests, inner_calls):
            print(f"durations: {line}")
        return 0
    failed = sorted(nodeid for nodeid, outcome in outcomes.items() if outcome == "failed")
    if failed:
        print(f"warning: {len(failed)} tests failed in this run; their times may be short", file=sys.stderr)
    note = args.note
    if args.merge:
        files, tests, note = merged(json.loads(DURATIONS.read_text()), files, tests, note)
    data = write(files, tests, note)
    print(f"wrote {DURATIONS.relative_to(ROOT)}: {len(files)} files, {data['total_seconds'] / 60:.1f} min in all "
          f"({data['machine']})")
    print(f"\n{'seconds':>8}  slowest files")
    for path, s in list(data["files"].items())[: args.top]:
        print(f"{s:8.1f}  {path}")
    print(f"\n{'seconds':>8}  slowest tests")
    for nodeid, s in list(data["slowest_tests"].items())[: args.top]:
        print(f"{s:8.1f}  {nodeid}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
