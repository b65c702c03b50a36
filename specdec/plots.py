"""Plots of benchmark results: a PNG beside each JSON result (``specdec bench --out``, ``benchmarks/*.py``).

Torch-free. matplotlib is imported on the first plot only, and drawn with its Agg canvas (a figure of its own,
never pyplot's global state, so nothing opens a window and nothing leaks between plots). Without matplotlib,
:func:`save_figure` raises :class:`PlotsUnavailable`, whose message says ``pip install 'specdec[bench]'``;
callers log a warning and skip the plot: a benchmark never fails for want of a picture.

Panels (each also a one-panel figure of its own):
  * ``throughput``: output tokens/s against concurrent streams, one line per setup
    (rows ``{"setup": str, "streams": int, "tokens/s": float}``, as ``benchmarks/bench_concurrency.py`` writes);
  * ``acceptance``: acceptance rate per draft position 1..k, bars, one colour per setup
    (``[rate, ...]`` or ``{setup: [rate, ...]}``; a rate is accepted at that position / drafting rounds);
  * ``latency``: TTFT / TPOT / ITL / E2E at p50 / p90 / p99, grouped bars (``specdec bench``'s
    ``{"ttft_ms": {"p50": ..}, ...}``).
:func:`serving_benchmark` draws a ``specdec bench`` result (latency, and acceptance where drafts were made).
Each figure has a caption line naming the machine (CPU model, cores, SIMD flags, torch version).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install 'specdec[bench]'"
DPI = 100
PANEL_SIZE = (6.4, 4.4)  # inches, per panel
LATENCY_METRICS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))
PERCENTILES = ("p50", "p90", "p99")
# the flags that decide a CPU forward pass's speed (as specdec.engine.dtype_choice.CPU_FLAGS, plus VNNI / AMX int8)
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


class PlotsUnavailable(ImportError):
    """matplotlib is not installed."""


# --------------------------------------------------------------------------------------------------
# the machine


def cpu_info() -> dict[str, Any]:
    """CPU model, cores and flags from /proc/cpuinfo (shaped as ``benchmarks/common.py``'s ``cpu_info``)."""
    model, flags = None, set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (s.strip() for s in line.partition(":"))
            if key == "model name" and model is None:
                model = value
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
            if model and flags:
                break
    return {"model": model or platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "flags": sorted(flags)}


def machine_caption(cpu: Mapping[str, Any] | None = None, torch_version: str | None = None, prefix: str = "") -> str:
    """One line: ``[prefix · ]CPU <model>, <n> cores, <flags> · torch <version> · <OS>``.

    ``cpu``: a ``{"model", "cores", "flags"}`` mapping (``benchmarks/common.py``'s ``cpu_info()``), else read
    here; ``torch_version``: else the installed torch distribution's (read from its metadata: nothing imported).
    """
    cpu = cpu or cpu_info()
    flags = [f for f in CPU_FLAGS if f in set(cpu.get("flags") or ())]
    parts = [f"CPU {cpu.get('model') or 'unknown'}" + (f", {cpu['cores']} cores" if cpu.get("cores") else "")
             + (f", {' '.join(flags)}" if flags else ", no avx2/avx512/amx")]
    if torch_version is None:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            torch_version = importlib.metadata.version("torch")
    if torch_version:
        parts.append(f"torch {torch_version}")
    parts.append(platform.system() + " " + platform.machine())
    return " · ".join(([prefix] if prefix else []) + parts)


# --------------------------------------------------------------------------------------------------
# panels


def per_position_rates(accepted_per_position: Sequence[float], num_drafts: float) -> list[float]:
    """Acceptance rate at each draft position: tokens accepted there / drafting rounds (vLLM's definition)."""
    return [a / num_drafts for a in accepted_per_position] if num_drafts else []


def _draw_throughput(ax, rows: Sequence[Mapping[str, Any]]) -> None:
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r.get("tokens/s") is not None:
            series.setdefault(str(r.get("setup", "")), []).append((int(r["streams"]), float(r["tokens/s"])))
    levels = sorted({n for points in series.values() for n, _ in points})
    for name, points in series.items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=name or None)
    if levels and levels[-1] >= 4 * max(levels[0], 1):
        ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(n) for n in levels])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_title("Throughput vs concurrency")
    ax.set_xlabel("concurrent streams (requests in flight)")
    ax.set_ylabel("output tokens/s (all streams)")
    ax.grid(alpha=0.3)
    if any(series):
        ax.legend(fontsize=8)


def _draw_acceptance(ax, rates: Sequence[float] | Mapping[str, Sequence[float]]) -> None:
    series = dict(rates) if isinstance(rates, Mapping) else {"": list(rates)}
    k = max((len(v) for v in series.values()), default=0)
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [p + 1 + (i - (len(series) - 1) / 2) * width for p in range(len(values))]
        bars = ax.bar(xs, values, width=width, label=name or None)
        if len(series) * k <= 24:
            ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    ax.set_xticks(range(1, k + 1))
    ax.set_ylim(0, 1.1)
    ax.set_title("Acceptance by draft position")
    ax.set_xlabel("draft position (1 = first proposed token)")
    ax.set_ylabel("acceptance rate (accepted / drafting rounds)")
    ax.grid(axis="y", alpha=0.3)
    if len(series) > 1 or next(iter(series), ""):
        ax.legend(fontsize=8)
    if not k:
        ax.text(0.5, 0.5, "no drafts", ha="center", va="center", transform=ax.transAxes)


def _draw_latency(ax, stats: Mapping[str, Mapping[str, float]]) -> None:
    metrics = [(key, label) for key, label in LATENCY_METRICS if key in stats]
    width = 0.8 / len(PERCENTILES)
    for i, q in enumerate(PERCENTILES):
        xs = [m + (i - (len(PERCENTILES) - 1) / 2) * width for m in range(len(metrics))]
        values = [float(stats[key].get(q) or 0.0) for key, _ in metrics]
        bars = ax.bar(xs, values, width=width, label=q)
        ax.bar_label(bars, labels=[("" if v <= 0 else f"{v:.0f}" if v >= 100 else f"{v:.3g}") for v in values],
                     fontsize=6, padding=1)
    if any(float(stats[key].get(q) or 0) > 0 for key, _ in metrics for q in PERCENTILES):
        ax.set_yscale("log")  # E2E is seconds, ITL milliseconds
    ax.set_xticks(range(len(metrics)), [label for _, label in metrics])
    ax.set_title("Latency percentiles")
    ax.set_xlabel("TTFT: to first token · TPOT: per output token · ITL: between chunks · E2E: whole request",
                  fontsize=7)
    ax.set_ylabel("latency (ms, log scale)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)


PANELS = {"throughput": _draw_throughput, "acceptance": _draw_acceptance, "latency": _draw_latency}


# --------------------------------------------------------------------------------------------------
# figures


def save_figure(path: str | Path, panels: Sequence[tuple[str, Any]], *, title: str | None = None,
                caption: str | None = None) -> Path:
    """Draw ``panels`` (``(kind, data)``, kind one of :data:`PANELS`) side by side into the PNG ``path``.

    ``caption``: the line under the panels (default :func:`machine_caption`). Raises
    :class:`PlotsUnavailable` without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotsUnavailable(f"plots need matplotlib: {INSTALL_HINT}") from exc
    if not panels:
        raise ValueError("save_figure: no panels to draw")
    unknown = [kind for kind, _ in panels if kind not in PANELS]
    if unknown:
        raise ValueError(f"save_figure: unknown panel kinds {unknown}; known: {sorted(PANELS)}")
    fig = Figure(figsize=(PANEL_SIZE[0] * len(panels), PANEL_SIZE[1] + 0.4 + (0.3 if title else 0)), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (kind, data) in zip(axes, panels):
        PANELS[kind](ax, data)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.text(0.01, 0.01, caption if caption is not None else machine_caption(), fontsize=7, color="0.35")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI)
    return path


def throughput_vs_concurrency(rows: Sequence[Mapping[str, Any]], path: str | Path, *, title: str | None = None,
                              caption: str | None = None) -> Path:
    """Output tokens/s against concurrency, a line per setup (rows with ``setup``, ``streams``, ``tokens/s``)."""
    return save_figure(path, [("throughput", rows)], title=title, caption=caption)


def acceptance_by_position(rates: Sequence[float] | Mapping[str, Sequence[float]], path: str | Path, *,
                           title: str | None = None, caption: str | None = None) -> Path:
    """Acceptance rate per draft position 1..k (a list, or a list per setup), as bars."""
    return save_figure(path, [("acceptance", rates)], title=title, caption=caption)


def latency_percentiles(stats: Mapping[str, Mapping[str, float]], path: str | Path, *, title: str | None = None,
                        caption: str | None = None) -> Path:
    """TTFT / TPOT / ITL / E2E (``ttft_ms`` ... ``e2e_ms``, each ``{"p50", "p90", "p99"}`` in ms) as grouped bars."""
    return save_figure(path, [("latency", stats)], title=title, caption=caption)


def serving_benchmark(result: Mapping[str, Any], path: str | Path) -> Path:
    """A ``specdec bench`` result (its JSON): latency percentiles and, where drafts were made, the acceptance rate
    per draft position, side by side. The caption names the machine the client ran on."""
    panels: list[tuple[str, Any]] = [("latency", {key: result[key] for key, _ in LATENCY_METRICS})]
    if result["spec_decode"].get("acceptance_rate_per_pos"):
        panels.append(("acceptance", result["spec_decode"]["acceptance_rate_per_pos"]))
    c = result["config"]
    title = (f"specdec bench: {c['model']} ({c['endpoint']}), {result['completed']} requests x {c['max_tokens']} "
             f"tokens, concurrency {c['concurrency'] or 'unlimited'}: {result['output_throughput']:.1f} output tok/s")
    return save_figure(path, panels, title=title, caption=machine_caption(prefix="client machine"))
