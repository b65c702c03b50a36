"""Compile every Triton kernel ahead of time for sm_90 (no GPU needed; run WITHOUT TRITON_INTERPRET):
``python -m tests.kernels.aot [MODULE ...]`` (all modules, or those named) prints one JSON line
{kernel: {cubin, div_rn, div_full, sqrt_rn, wgmma, tf32, atomics}}; exit 3 when this triton cannot compile for
CUDA here (no ptxas). A kernel made on first use is named by its factory: ``_kernel()``, ``_kernels()[1]``."""

from __future__ import annotations

import importlib
import json
import os
import re
import sys

# (module, kernel, signature, constexprs[, a label telling two compiles of one kernel apart])
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
    *[("kernels.paged_attention", "_kernel()[0]",
       {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "tables_ptr": "*i32",
        "ctx_ptr": "*i32", "qsl_ptr": "*i32", "seq_of_ptr": "*i32", "part_ptr": "*fp32",
        **{s: "*i32" for s in ("tpos_ptr", "tstart_ptr", "toff_ptr", "tslots_ptr")},
        **{s: "i32" for s in ("q_t", "q_h", "q_d", "k_h", "k_s", "k_d", "v_h", "v_s", "v_d", "o_t", "o_h",
                              "table_stride")},
        "scale": "fp32", "window": "i32", "group": "i32", "head_dim": "i32", "block_size": "i32", "max_splits": "i32",
        "HAS_WINDOW": "constexpr", "BLOCK_N": "constexpr", "BLOCK_D": "constexpr", "SPLIT_BLOCKS": "constexpr",
        "PARALLEL": "constexpr", "HAS_TREE": "constexpr"},
       # the split variant with token trees' paths, the one-program variant without
       {"HAS_WINDOW": True, "BLOCK_N": 16, "BLOCK_D": 64, "SPLIT_BLOCKS": 32, "PARALLEL": parallel, "HAS_TREE": parallel},
       "splits" if parallel else "")
      for parallel in (False, True)],
    ("kernels.paged_attention", "_kernel()[1]",
     {"out_ptr": "*bf16", "ctx_ptr": "*i32", "qsl_ptr": "*i32", "seq_of_ptr": "*i32", "part_ptr": "*fp32",
      "tpos_ptr": "*i32", "o_t": "i32", "o_h": "i32", "window": "i32", "head_dim": "i32", "block_size": "i32",
      "max_splits": "i32", "HAS_WINDOW": "constexpr", "BLOCK_D": "constexpr", "SPLIT_BLOCKS": "constexpr",
      "HAS_TREE": "constexpr"},
     {"HAS_WINDOW": True, "BLOCK_D": 64, "SPLIT_BLOCKS": 32, "HAS_TREE": True}),
    *[("kernels.batch_invariant", "_kernels()[0]",
       {"x_ptr": dtype, "w_ptr": dtype, "b_ptr": dtype, "out_ptr": dtype,
        **{s: "i32" for s in ("M", "N", "K", "x_m", "x_k", "w_n", "w_k", "o_m", "o_n")},
        **{c: "constexpr" for c in ("HAS_BIAS", "IEEE", "UPCAST", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}},
       {"HAS_BIAS": True, "IEEE": dtype == "*fp32", "UPCAST": False, "BLOCK_M": 64, "BLOCK_N": 64,
        "BLOCK_K": 32 if dtype == "*fp32" else 64, "GROUP_M": 8})
      for dtype in ("*bf16", "*fp32")],
    ("kernels.batch_invariant", "_kernels()[1]",
     {"x_ptr": "*bf16", "out_ptr": "*fp32", "N": "i32", "x_m": "i32", "o_m": "i32", "eps": "fp32",
      "BLOCK": "constexpr"}, {"BLOCK": 1024}),
]


def _kernel(module: str, name: str):
    """``name``: a module-level jit kernel, or ``factory()`` / ``factory()[i]``: one made on first use."""
    factory, call, index = name.partition("()")
    fn = getattr(importlib.import_module(module), factory)
    if call:
        fn = fn()
        if index:
            fn = fn[int(index.strip("[]"))]
    return fn


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("run without TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    report = {}
    for module, name, signature, constexprs, *label in KERNELS:
        if sys.argv[1:] and module not in sys.argv[1:]:
            continue
        fn = _kernel(module, name)
        try:
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                      target=GPUTarget("cuda", 90, 32))
        except (FileNotFoundError, RuntimeError) as exc:
            if "ptxas" in str(exc):
                print(f"no ptxas in this triton: {exc}")
                return 3
            raise
        ptx = compiled.asm.get("ptx", "")
        key = fn.__name__ + ("" if name == fn.__name__ else f"[{signature[next(iter(signature))].lstrip('*')}]")
        key += f"[{label[0]}]" if label and label[0] else ""
        report[key] = {"cubin": bool(compiled.asm.get("cubin")), "div_rn": "div.rn.f32" in ptx,
                       "div_full": "div.full.f32" in ptx, "sqrt_rn": "sqrt.rn.f32" in ptx, "wgmma": "wgmma." in ptx,
                       "tf32": ".tf32" in ptx, "atomics": bool(re.search(r"\b(atom|red)\.", ptx))}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
