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


def test_plot_panels_found_by_the_results_shape(common):
    """write_json's PNG: a line per setup where the rows sweep ``streams`` (one per throughput column where a row
    has several), bars per setup where speculation stats hold accepted_per_position; nothing to draw, no panels."""
    sweep = [{"setup": s, "streams": n, "tokens/s": 10.0 * n, "identical": True} for s in ("a", "b") for n in (1, 4)]
    assert common.plot_panels({"rows": sweep}) == [("throughput", [
        {"setup": r["setup"], "streams": r["streams"], "tokens/s": r["tokens/s"]} for r in sweep])]
    two = [{"dtype": "float32", "mode": "target alone", "streams": n, "off tok/s": 1.0, "on tok/s": 2.0, "on/off": 2.0}
           for n in (1, 8)]
    assert {r["setup"] for r in common.sweep_rows(two)} == {"float32 target alone, off tok/s",
                                                           "float32 target alone, on tok/s"}
    assert common.sweep_rows([{"setup": "a", "streams": 8, "tokens/s": 1.0}]) == []  # one level: no sweep
    stats = {"num_drafts": 10, "accepted_per_position": [8, 5, 2]}
    assert common.plot_panels({"spec_stats": stats}) == [("acceptance", {"specdec": [0.8, 0.5, 0.2]})]
    details = {"details": {"coupled k=3": {"spec_stats": stats}, "spec off": {"spec_stats": {"num_drafts": 0}}}}
    assert common.position_rates(details) == {"coupled k=3": [0.8, 0.5, 0.2]}
    assert common.plot_panels({"rows": [{"setup": "a", "tokens/s": 1.0}]}) == []


def test_write_json_writes_the_png_beside_it(common, tmp_path, capsys):
    sweep = [{"setup": s, "streams": n, "tokens/s": 10.0 * n} for s in ("a", "b") for n in (1, 4)]
    common.write_json(tmp_path / "r.json", {"smoke": True, "rows": sweep,
                                            "spec_stats": {"num_drafts": 4, "accepted_per_position": [3, 1]}})
    png = (tmp_path / "r.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert f"wrote {tmp_path / 'r.png'}" in capsys.readouterr().out
    common.write_json(tmp_path / "plain.json", {"rows": [{"setup": "a", "tokens/s": 1.0}]})
    assert not (tmp_path / "plain.png").exists()  # nothing that plots


def test_without_matplotlib_write_json_still_writes_the_json(common, tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were not installed
    rows = [{"setup": "a", "streams": n, "tokens/s": 1.0} for n in (1, 2)]
    common.write_json(tmp_path / "r.json", {"rows": rows})
    assert (tmp_path / "r.json").is_file() and not (tmp_path / "r.png").exists()
    assert "no plot written" in caplog.text and "pip install 'specdec[bench]'" in caplog.text
