"""Compile every Triton kernel ahead of time for sm_90 (no GPU needed; run WITHOUT TRITON_INTERPRET):
``python -m tests.kernels.aot`` prints one JSON line {kernel: {cubin, div_rn, div_full}}; exit 3 when this
triton cannot compile for CUDA here (no ptxas)."""

from __future__ import annotations

import json
import os
import sys

# (module, kernel, signature, constexprs)
KERNELS = [
    ("kernels.rejection", "_argmax_kernel",
     {"x_ptr": "*fp32", "rows_ptr": "*i64", "out_ptr": "*i64", "vocab": "i32", "stride": "i64", "BLOCK": "constexpr"},
     {"BLOCK": 4096}),
    ("kernels.rejection", "_accept_kernel",
     {"draft_ptr": "*i64", "cu_ptr": "*i64", "target_ptr": "*fp32", "t_stride": "i64", "q_ptr": "*fp32",
      "q_stride": "i64", "q_start_ptr": "*i64", "greedy_ptr": "*i32", "argmax_ptr": "*i64", "u_ptr": "*fp32",
      "noise_ptr": "*fp32", "n_stride": "i64", "noise_row_ptr": "*i64", "out_ptr": "*i64", "batch": "i32",
      "vocab": "i32", "HAS_Q": "constexpr", "BLOCK": "constexpr"},
     {"HAS_Q": True, "BLOCK": 4096}),
    ("kernels.tli", "_scatter_kernel",
     {"src_ptr": "*fp32", "src_stride": "i64", "src_ids_ptr": "*i64", "dst_ids_ptr": "*i64", "out_ptr": "*fp32",
      "out_stride": "i64", "n_pairs": "i32", "BLOCK": "constexpr"}, {"BLOCK": 1024}),
    ("kernels.tli", "_mask_kernel",
     {"x_ptr": "*fp32", "keep_ptr": "*i8", "out_ptr": "*fp32", "stride": "i64", "vocab": "i32", "n_keep": "i32",
      "fill": "fp32", "BLOCK": "constexpr"}, {"BLOCK": 1024}),
    ("kernels.logits", "_temperature_softmax_kernel",
     {"x_ptr": "*fp32", "t_ptr": "*fp32", "out_ptr": "*fp32", "stride": "i64", "vocab": "i32", "BLOCK": "constexpr"},
     {"BLOCK": 4096}),
]


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("run without TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    report = {}
    for module, name, signature, constexprs in KERNELS:
        fn = getattr(importlib.import_module(module), name)
        try:
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                      target=GPUTarget("cuda", 90, 32))
        except (FileNotFoundError, RuntimeError) as exc:
            if "ptxas" in str(exc):
                print(f"no ptxas in this triton: {exc}")
                return 3
            raise
        ptx = compiled.asm.get("ptx", "")
        report[name] = {"cubin": bool(compiled.asm.get("cubin")), "div_rn": "div.rn.f32" in ptx,
                        "div_full": "div.full.f32" in ptx}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
