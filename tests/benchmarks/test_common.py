"""benchmarks/common.py's ``report_checks``: a failed check prints FAIL and makes the exit status 1; a missed goal
prints MISS and leaves it 0, unless ``strict``, where it is a FAIL too. So a script's FAIL line is its exit status."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def common(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_common", BENCH / "common.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_all_passing_is_status_0(common, capsys):
    assert common.report_checks({"answered": True}, {"fast": True}) == 0
    assert capsys.readouterr().out.splitlines() == ["PASS: answered", "PASS: fast"]


def test_a_failed_check_is_status_1(common, capsys):
    assert common.report_checks({"answered": True, "identical": False}, {"fast": True}) == 1
    assert capsys.readouterr().out.splitlines() == ["PASS: answered", "FAIL: identical", "PASS: fast"]


def test_a_missed_goal_is_informational_unless_strict(common, capsys):
    assert common.report_checks({"answered": True}, {"fast": False}) == 0
    out = capsys.readouterr().out
    assert "MISS: fast" in out and "FAIL" not in out
    assert common.report_checks({"answered": True}, {"fast": False}, strict=True) == 1
    assert "FAIL: fast" in capsys.readouterr().out


def test_strict_is_a_flag(common):
    ap = argparse.ArgumentParser()
    common.add_strict_arg(ap)
    assert ap.parse_args(["--strict"]).strict is True and ap.parse_args([]).strict is False


@pytest.mark.parametrize("script", ["soak.py", "bench_metrics.py", "bench_kv_serving.py"])
def test_the_scripts_return_report_checks_status(script):
    """Each script with PASS/FAIL lines prints them through report_checks and exits with its status (the smoke
    runs in tests/benchmarks/test_smoke.py run them; this pins that no script prints its own)."""
    text = (BENCH / script).read_text()
    assert "report_checks(" in text and "return status" in text, script
    assert "'PASS' if ok else 'FAIL'" not in text, script
