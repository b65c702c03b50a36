"""What ``--dtype auto`` means on a CPU: the faster of float32 and bfloat16 *on this machine*, measured.

A decoder pass over a few tokens is bound by reading the weights. bfloat16 halves the bytes but needs the
CPU's bf16 instructions to multiply them fast, so which dtype wins depends on the CPU. Whole SmolLM2-135M lean
passes of 1 token, 2 threads, as measured for the issue: Intel Xeon with AMX, float32 ~20-30 ms, bfloat16
~13 ms; AMD EPYC machines without AMX: bfloat16 faster too. This module's own measurement of SmolLM2-135M's shapes
on a 2-core AMD EPYC with avx512_bf16, no AMX: float32 0.96 ms, bfloat16 0.46 ms at 2 threads (1.24 / 0.57 ms
at 1). Other machines may differ, so there is no rule: once per machine, :func:`cpu_auto_choice` times the
lean forward's own products (:class:`specdec.engine.lean_linear.LeanLinear`: oneDNN on packed weights for
bf16, skinny / oneDNN for fp32) on random weights of the model's size -- the fused q|k|v [3*hidden, hidden],
gate|up [2*intermediate, hidden] and down [hidden, intermediate] products at 1 and at 4 rows, each weight in
enough copies to be read from memory as in a real pass, each call at its best of a few rounds after a warm-up
-- and picks bfloat16 only if it is at least 10% faster (both row counts summed); otherwise float32, the more
exact. It takes about a second (more on a busy machine), and the choice is cached in
``$SPECDEC_CACHE/dtype_auto.json``, keyed by the CPU (its model name and its avx2 / avx512f / avx512_bf16 /
amx_bf16 / amx_tile flags), torch's version, the thread count and the shape.

``SPECDEC_DTYPE_AUTO_CACHE=0`` measures again and rewrites the entry. ``SPECDEC_DTYPE_AUTO=float32|bfloat16``
pins what ``auto`` means on CPU, without measuring (an operator's choice; the test suite pins float32
because it compares against float32 references). Where oneDNN has no bf16 here, ``auto`` is float32 and
nothing is timed. An explicit dtype is never overridden; CUDA keeps bfloat16 by rule
(:func:`specdec.engine.models.load_model`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.engine.cache_files import cache_root, file_lock, read_json_dict, write_json_atomic

logger = logging.getLogger(__name__)

PIN_ENV = "SPECDEC_DTYPE_AUTO"  # float32 | bfloat16: what auto means on CPU, unmeasured
CACHE_ENV = "SPECDEC_DTYPE_AUTO_CACHE"  # 0: measure again
CACHE_FILE = "dtype_auto.json"
MARGIN = 0.10  # bfloat16 must be this much faster than float32
ROWS = (1, 4)  # a draft step or plain decoding; a verification pass
REPEATS = 5  # rounds timed after the warm-up round; the best counts
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
_WORKING_SET = 64 << 20  # bytes of a shape's copies per dtype: read from memory, as a real pass's weights
_BUDGET_S = 3.0  # past this, each remaining product gets one timed round (a busy machine makes calls slow)
_MAX_WEIGHT = 64 << 20  # fp32 bytes of one weight at most (a big model's are cut in their output rows)
_CHOICES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
MEASURED = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_LOCK = threading.Lock()  # one measurement at a time in a process: two would slow each other


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class DtypeChoice:
    dtype: torch.dtype
    how: str  # "measured", "cached", "pinned" or "unsupported"
    ms: dict[str, float] = field(default_factory=dict)  # per dtype: the products' best times, summed
    cpu: str = ""
    cache: Path | None = None

    def describe(self) -> str:
        if self.how == "pinned":
            return f"{dtype_name(self.dtype)} (pinned by {PIN_ENV})"
        if self.how == "unsupported":
            return f"{dtype_name(self.dtype)} (no oneDNN bfloat16 products on this CPU)"
        where = "cached in" if self.how == "measured" else "read from"
        return (f"{dtype_name(self.dtype)} ({self.how}: float32 {self.ms['float32']:.2f} ms, bfloat16 "
                f"{self.ms['bfloat16']:.2f} ms for a layer's q|k|v, gate|up and down products at "
                f"{' + '.join(map(str, ROWS))} rows on {self.cpu}; {where} {self.cache})")


def pinned_dtype() -> torch.dtype | None:
    """``$SPECDEC_DTYPE_AUTO``: the dtype an operator pinned ``auto`` to on CPU, or None (measure)."""
    value = os.environ.get(PIN_ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in _CHOICES:
        raise ValueError(f"{PIN_ENV}={value!r}: use float32 or bfloat16 (or unset it to measure)")
    return _CHOICES[value]


def bf16_supported() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                    and torch.ops.mkldnn._reorder_linear_weight and torch.ops.mkldnn._linear_pointwise)
    except (AttributeError, RuntimeError):  # ops missing from this torch build
        return False


def cpu_info() -> tuple[str, list[str]]:
    """The CPU's model name and which of :data:`CPU_FLAGS` it has (from /proc/cpuinfo where there is one)."""
    name, flags = "", None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (s.strip() for s in line.partition(":"))
            if key == "model name" and not name:
                name = value
            elif key in ("flags", "Features") and flags is None:
                flags = set(value.split())
            if name and flags is not None:
                break
    return name or platform.processor() or platform.machine(), [f for f in CPU_FLAGS if f in (flags or ())]


def shapes(hidden: int, intermediate: int) -> list[tuple[int, int]]:
    return [(3 * hidden, hidden), (2 * intermediate, hidden), (hidden, intermediate)]


@torch.inference_mode()
def time_products(hidden: int, intermediate: int) -> dict[str, float]:
    """Milliseconds per dtype: each shape's product at each of :data:`ROWS` rows, summed. Each call is timed
    alone and counts at its best of :data:`REPEATS` rounds (a round calls every copy once, so a weight is
    read from memory, as in a pass); the dtypes take turns round by round, so a busy neighbour slows both."""
    from specdec.engine.lean_linear import LeanLinear

    gen = torch.Generator().manual_seed(0)
    total = dict.fromkeys(MEASURED, 0.0)
    deadline = time.perf_counter() + _BUDGET_S
    for out, inp in shapes(hidden, intermediate):
        out = max(1, min(out, _MAX_WEIGHT // (4 * inp)))
        weight = torch.randn(out, inp, generator=gen) * 0.02
        linears = {name: [LeanLinear(weight.to(dtype, copy=True))
                          for _ in range(max(1, min(64, _WORKING_SET // (out * inp * dtype.itemsize))))]
                   for name, dtype in MEASURED.items()}
        for rows in ROWS:
            xs = {name: torch.randn(rows, inp, generator=gen).to(dtype) for name, dtype in MEASURED.items()}
            best = {name: [float("inf")] * len(linears[name]) for name in MEASURED}
            for round_ in range(REPEATS + 1):  # round 0 warms up
                if round_ > 1 and time.perf_counter() > deadline:
                    break
                for name, copies in linears.items():
                    for i, linear in enumerate(copies):
                        start = time.perf_counter()
                        linear(xs[name])
                        if round_:
                            best[name][i] = min(best[name][i], time.perf_counter() - start)
            for name in MEASURED:
                total[name] += 1e3 * sum(best[name]) / len(best[name])
        del linears
    return total


def cpu_auto_choice(hidden: int, intermediate: int, threads: int | None = None) -> DtypeChoice:
    """The dtype ``auto`` means on this CPU for a model of this size, and why (see the module)."""
    pin = pinned_dtype()
    if pin is not None:
        return DtypeChoice(pin, "pinned")
    if not bf16_supported():
        return DtypeChoice(torch.float32, "unsupported")
    threads = threads or torch.get_num_threads()
    cpu, flags = cpu_info()
    key = " | ".join([cpu, ",".join(flags) or "-", f"torch {torch.__version__}", f"{threads} threads",
                      f"hidden {hidden}, intermediate {intermediate}"])
    path = cache_root() / CACHE_FILE
    with _LOCK, file_lock(path):
        entries = read_json_dict(path)
        hit = entries.get(key)
        if isinstance(hit, dict) and os.environ.get(CACHE_ENV, "1").strip() != "0":
            with contextlib.suppress(KeyError, TypeError, ValueError, AttributeError):  # malformed: measure
                ms = {name: float(hit["ms"][name]) for name in MEASURED}
                return DtypeChoice(_CHOICES[hit["dtype"]], "cached", ms, cpu, path)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            ms = time_products(hidden, intermediate)
        finally:
            torch.set_num_threads(before)
        dtype = torch.bfloat16 if ms["bfloat16"] <= (1 - MARGIN) * ms["float32"] else torch.float32
        entries[key] = {"dtype": dtype_name(dtype), "ms": ms, "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        _write(path, entries)
    choice = DtypeChoice(dtype, "measured", ms, cpu, path)
    logger.debug("dtype auto: %s", choice.describe())
    return choice


def cpu_auto_dtype(hidden: int, intermediate: int, threads: int | None = None) -> torch.dtype:
    return cpu_auto_choice(hidden, intermediate, threads).dtype


def _write(path: Path, entries: dict) -> None:
    try:
        write_json_atomic(path, entries)
    except OSError as exc:
        logger.warning("could not cache the dtype choice in %s (%s); it will be measured again", path, exc)
