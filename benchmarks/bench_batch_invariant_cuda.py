"""Batch-invariant Triton matmul and RMS norm (kernels/batch_invariant.py) vs torch on a CUDA GPU: are rows
bitwise identical whatever M, and what does the fixed tile configuration cost against cuBLAS?

For each weight shape (N x K) and M, a case times ``matmul`` (Triton, one config for every M) and
``torch.nn.functional.linear`` (cuBLAS, its heuristics pick per M), and checks invariance the way
tests/kernels/test_batch_invariant.py does: rows 0, M/2 and M-1 of the M-row product against the same rows
computed alone (M = 1), ``torch.equal``. torch's own invariance is reported beside (often False: cuBLAS picks a
different kernel, or split-K, for a small M). RMS-norm rows likewise, against the torch formula.

    python benchmarks/bench_batch_invariant_cuda.py                    # bf16, SmolLM2-135M and 7B-sized shapes
    python benchmarks/bench_batch_invariant_cuda.py --dtypes bf16,fp32 --ms 1,8,37,512

CUDA only: without a CUDA device it says so and exits with status 2 (the interpreter is not a speed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import add_common_args, json_path, print_table, ratio, write_json  # noqa: E402

COLUMNS = ["op", "shape", "M", "triton ms", "torch ms", "triton / torch", "triton invariant", "torch invariant",
           "max |triton - torch|"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SHAPES = "576x576,1536x576,49152x576,4096x4096,14336x4096"  # N x K: SmolLM2-135M's projections and head, a 7B's
NORM_WIDTHS = (576, 4096)


def _time(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    times.sort()
    return 1000 * times[len(times) // 2]


def _invariant(fn, x: torch.Tensor) -> bool:
    """Rows 0, M/2, M-1 of ``fn(x)`` equal ``fn`` of that row alone, bit for bit."""
    full = fn(x)
    rows = sorted({0, x.shape[0] // 2, x.shape[0] - 1})
    return all(torch.equal(full[i], fn(x[i: i + 1].clone())[0]) for i in rows)


def matmul_case(n, k, m, dtype, reps):
    from kernels.batch_invariant import matmul_triton

    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k ** 0.5
    plain = torch.nn.functional.linear
    return {"op": f"matmul {str(dtype)[6:]}", "shape": f"{n}x{k}", "M": m,
            "triton ms": _time(lambda: matmul_triton(x, w), reps), "torch ms": _time(lambda: plain(x, w), reps),
            "triton invariant": _invariant(lambda a: matmul_triton(a, w), x),
            "torch invariant": _invariant(lambda a: plain(a, w), x),
            "max |triton - torch|": (matmul_triton(x, w).float() - plain(x, w).float()).abs().max().item()}


def rms_norm_case(width, m, dtype, reps):
    from kernels.batch_invariant import rms_norm_reference, rms_norm_triton

    x = torch.randn(m, width, device="cuda", dtype=dtype, generator=torch.Generator(device="cuda").manual_seed(m))
    return {"op": f"rms_norm {str(dtype)[6:]}", "shape": f"{width}", "M": m,
            "triton ms": _time(lambda: rms_norm_triton(x, 1e-6), reps),
            "torch ms": _time(lambda: rms_norm_reference(x, 1e-6), reps),
            "triton invariant": _invariant(lambda a: rms_norm_triton(a, 1e-6), x),
            "torch invariant": _invariant(lambda a: rms_norm_reference(a, 1e-6), x),
            "max |triton - torch|": (rms_norm_triton(x, 1e-6) - rms_norm_reference(x, 1e-6)).abs().max().item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--dtypes", default="bf16", help=f"comma-separated, of {list(DTYPES)}")
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated N x K weight shapes")
    ap.add_argument("--ms", default="1,8,37,128,512,2048", help="comma-separated row counts")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_batch_invariant_cuda.py needs a CUDA device (none here); the CPU checks are "
              "tests/kernels/test_batch_invariant.py under TRITON_INTERPRET=1", file=sys.stderr)
        sys.exit(2)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: this benchmark times the compiled kernels")
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms, reps = [int(v) for v in args.ms.split(",")], args.reps
    if args.smoke:
        shapes, ms, reps = shapes[:1], ms[:2], 3
    rows = []
    for dtype in dtypes:
        for n, k in shapes:
            for m in ms:
                rows.append(matmul_case(n, k, m, dtype, reps))
                print(rows[-1], flush=True)
        for width in NORM_WIDTHS:
            for m in ms:
                rows.append(rms_norm_case(width, m, dtype, reps))
                print(rows[-1], flush=True)
    for r in rows:
        r["triton / torch"] = ratio(r["triton ms"], r["torch ms"])
    print()
    print_table(rows, COLUMNS)
    summary = {"all_triton_invariant": all(r["triton invariant"] for r in rows),
               "torch_invariant_cases": sum(bool(r["torch invariant"]) for r in rows), "cases": len(rows)}
    print(f"\nTriton rows invariant in every case: {summary['all_triton_invariant']}; torch's in "
          f"{summary['torch_invariant_cases']} of {summary['cases']}")
    write_json(json_path(args, "bench_batch_invariant_cuda"), {
        "smoke": bool(args.smoke), "gpu": torch.cuda.get_device_name(), "triton": _triton_version(),
        "rows": rows, **summary})
    sys.exit(0 if summary["all_triton_invariant"] else 1)


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    main()
