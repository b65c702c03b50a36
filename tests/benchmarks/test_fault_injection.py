"""benchmarks/fault_injection.py cannot rot or pass what fails: its smoke run (tiny models, real processes,
real signals) of the target's SIGSTOP and of admission past the limits exits 0 with PASS lines, and its
JSON holds what the clients saw: nothing lost, the overflow refused with RESOURCE_EXHAUSTED, the stopped
target an UNAVAILABLE well before SIGCONT, the same greedy answer afterwards."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _counts(saw: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"([^,:]+): (\d+)", saw)}


@pytest.mark.slow
def test_fault_injection_smoke(tmp_path):
    out = tmp_path / "faults.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fault_injection.py"), "--smoke",
                           "--only", "admission,sigstop", "--out", str(out), "--log-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {r["scenario"].split(",")[0]: r for r in json.loads(out.read_text())["rows"]}
    assert len(re.findall(r"^PASS: ", proc.stdout, re.M)) == 2 and "FAIL" not in proc.stdout

    admission = rows["40 concurrent gRPC calls"]
    saw = {k.strip(): v for k, v in _counts(admission["client saw"]).items()}
    # 8 running + 16 queued at once, the rest refused (a call may finish before the last ones arrive)
    assert set(saw) == {"OK", "gRPC RESOURCE_EXHAUSTED"} and sum(saw.values()) == 40, admission
    assert saw["OK"] >= 24 and saw["gRPC RESOURCE_EXHAUSTED"] >= 1, admission
    assert admission["lost"] == 0 and admission["correct after"] is True

    stop = rows["target SIGSTOP 20 s"]
    saw = {k.strip(): v for k, v in _counts(stop["client saw"]).items()}
    assert sum(saw.values()) == 9 and set(saw) <= {"OK", "gRPC UNAVAILABLE"}, stop
    assert saw.get("gRPC UNAVAILABLE", 0) >= 1  # at least the request sent while the target was stopped
    assert stop["slowest s"] < 20 and stop["lost"] == 0 and stop["correct after"] is True
