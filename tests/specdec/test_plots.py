"""specdec.plots: each figure is a real PNG with something drawn; no matplotlib is a clear error naming the extra;
importing the module loads neither torch nor matplotlib."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specdec import plots

LATENCY = {key: {"mean": 1.0, "p50": base, "p90": 1.5 * base, "p99": 2 * base}
           for key, base in (("ttft_ms", 80.0), ("tpot_ms", 20.0), ("itl_ms", 30.0), ("e2e_ms", 1500.0))}
SWEEP = [{"setup": setup, "streams": n, "tokens/s": rate * n ** 0.5}
         for setup, rate in (("target alone", 10.0), ("pair, grouped", 15.0)) for n in (1, 4, 8)]


def assert_png(path, min_bytes: int = 10_000) -> None:
    """A PNG (its signature) with more in it than an empty canvas compresses to."""
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n"), path
    assert len(data) > min_bytes, (path, len(data))


def test_throughput_vs_concurrency(tmp_path):
    out = plots.throughput_vs_concurrency(SWEEP, tmp_path / "sub" / "throughput.png", title="sweep")
    assert out == tmp_path / "sub" / "throughput.png"  # its folder made
    assert_png(out)


@pytest.mark.parametrize("rates", [[0.8, 0.55, 0.3], {"k=2": [0.9, 0.6], "k=3": [0.8, 0.5, 0.2]}, []],
                         ids=["one setup", "per setup", "no drafts"])
def test_acceptance_by_position(tmp_path, rates):
    assert_png(plots.acceptance_by_position(rates, tmp_path / "acceptance.png"), min_bytes=5_000)


def test_latency_percentiles_and_zeros(tmp_path):
    assert_png(plots.latency_percentiles(LATENCY, tmp_path / "latency.png"))
    zeros = {key: dict.fromkeys(("mean", "p50", "p90", "p99"), 0.0) for key in LATENCY}  # e.g. 1-token outputs
    assert_png(plots.latency_percentiles(zeros, tmp_path / "zeros.png"), min_bytes=5_000)


def test_two_panels_and_a_bench_result(tmp_path):
    assert_png(plots.save_figure(tmp_path / "both.png", [("latency", LATENCY), ("acceptance", [0.7, 0.4])]))
    result = {**LATENCY, "completed": 4, "output_throughput": 12.5,
              "config": {"model": "m", "endpoint": "completions", "max_tokens": 8, "concurrency": None},
              "spec_decode": {"acceptance_rate_per_pos": [0.75, 0.5]}}
    assert_png(plots.serving_benchmark(result, tmp_path / "bench.png"))
    with pytest.raises(ValueError, match="unknown panel kinds"):
        plots.save_figure(tmp_path / "x.png", [("pie", {})])


def test_per_position_rates():
    assert plots.per_position_rates([8, 5, 2], 10) == [0.8, 0.5, 0.2]
    assert plots.per_position_rates([], 0) == []


def test_machine_caption():
    caption = plots.machine_caption({"model": "Some CPU", "cores": 2, "flags": ["avx2", "avx512f", "sse4_2"]}, "2.9.0",
                                    prefix="client")
    assert caption.startswith("client · CPU Some CPU, 2 cores, avx2 avx512f · torch 2.9.0 · ")
    assert "no avx2/avx512/amx" in plots.machine_caption({"model": "Old", "flags": []}, "2.9.0")
    assert plots.machine_caption().startswith("CPU ")  # this machine's, read from /proc/cpuinfo where there is one


def test_without_matplotlib_the_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # importing it raises ImportError
    with pytest.raises(plots.PlotsUnavailable, match=r"pip install 'specdec\[bench\]'"):
        plots.latency_percentiles(LATENCY, tmp_path / "latency.png")
    assert not (tmp_path / "latency.png").exists()


def test_import_loads_neither_torch_nor_matplotlib():
    code = "import sys, specdec.plots; print(sorted({'torch', 'matplotlib'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
