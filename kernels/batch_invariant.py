"""Batch-invariant matmul and RMS norm in Triton: the target's logits for a position come out bitwise identical
whatever the shape of the pass that computes them (1 row or 37, the row's place in the batch, its neighbours).
See "Defeating Nondeterminism in LLM Inference" (Thinking Machines, 2025) and vLLM's ``VLLM_BATCH_INVARIANT=1``.

Why it holds, by construction:

* ``matmul``: ONE tile configuration per dtype (``MATMUL_CONFIGS``), never chosen from M (no autotune, no
  split-K, no atomics). Each program owns a ``[BLOCK_M, BLOCK_N]`` output tile and walks K from 0 to K in
  ``BLOCK_K`` steps, in order, accumulating ``tl.dot`` in fp32 (IEEE, never TF32, for fp32 inputs). An output
  element's sum therefore has the same terms in the same order whichever tile, program or batch it lands in;
  rows past M are masked to zeros and touch no other row. ``M`` is not specialised on (``do_not_specialize``), so
  a decode (M = 1) runs the very binary a 37-row pass runs.
* ``rms_norm``: one program per row, the row's squares summed in fixed ``RMS_BLOCK``-wide blocks in order, then
  one fixed-shape ``tl.sum``; the program never sees M.
* Both wrappers hand the kernels 16-byte-aligned tensors (a copy only for a misaligned view), ``rms_norm``
  contiguous ones: Triton specialises on pointer and stride alignment, and a differently vectorised load changes
  a 1-D reduction's layout on a GPU (sm_90: 8 bf16 per thread aligned, 4 not). The matmul's ``tl.dot`` takes
  its operands through shared memory in one MMA layout whatever the loads did.

The torch references (``matmul_reference``, ``rms_norm_reference``) are the plain formulas, in the same
precision (fp32 products and sums, one rounding to the output dtype). They are what ``backend="torch"`` runs; on
a CPU torch's own invariance is the engine's matter, not this module's.

Conventions as in ``kernels/paged_attention.py``: Triton is imported and the kernels jit-decorated on first use,
so this module imports without Triton (and before ``kernels.dispatch`` has chosen the interpreter on a CPU);
``backend`` is resolved by ``kernels.dispatch.resolve``.
"""

from __future__ import annotations

import functools

import torch

tl = None  # triton.language, imported by ``_kernels`` on first use, for the kernel bodies below

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The one tile configuration per dtype (the dtype is fixed per model; M never picks a config). 64 x 64 tiles keep
# a decode-sized pass (M of a few rows, N of a few hundred) spread over enough programs; BLOCK_K 32 for fp32
# keeps the FMA path's shared memory at the bf16 tiles' size.
MATMUL_CONFIGS = {
    torch.bfloat16: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
    torch.float16: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
    torch.float32: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3),
}
RMS_BLOCK = 1024   # columns of a row per step of rms_norm's reduction, for every M and N
RMS_WARPS = 4
_ALIGN = 16        # bytes: Triton's alignment specialisation


# ------------------------------------------------------------------------------------------------- checks


def _check_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"matmul needs x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} disagree on K "
                         f"({x.shape[1]} != {weight.shape[1]}); weight is [N, K], as nn.Linear keeps it")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one of {[str(d) for d in DTYPES]}, got {x.dtype} and "
                         f"{weight.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{weight.shape[0]}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    devices = {t.device for t in (x, weight, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"x, weight and bias must be on one device, got {sorted(map(str, devices))}")


def _check_rms_norm(x: torch.Tensor, eps: float) -> None:
    if x.dim() != 2:
        raise ValueError(f"rms_norm needs x [M, N], got {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"rms_norm supports {[str(d) for d in DTYPES]}, got {x.dtype}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


# ------------------------------------------------------------------------------------------------- references


def matmul_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The specification: ``x [M, K] @ weight[N, K].T (+ bias)`` with fp32 products and sums, rounded once to
    x's dtype: ``[M, N]``."""
    _check_matmul(x, weight, bias)
    out = x.float() @ weight.float().T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def rms_norm_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The specification: ``x [M, N]`` → fp32 ``x * rsqrt(mean(x^2) + eps)`` per row (the caller applies the
    weight)."""
    _check_rms_norm(x, eps)
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


# ------------------------------------------------------------------------------------------------- kernels


def _matmul_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
    x_m, x_k, w_n, w_k, o_m, o_n,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Program -> output tile, GROUP_M tile rows at a time (L2 reuse of the weight). Which program computes a
    # tile changes with M; what the tile's elements sum, and in which order, does not.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)          # [BLOCK_M] output rows
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)          # [BLOCK_N] output columns = weight rows
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * x_m      # [BLOCK_M, 1]
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * w_n      # [1, BLOCK_N]: the weight tile, transposed
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):                      # K in order, whole: no split-K
        ks = k0 + rk
        k_ok = ks < K
        a = tl.load(x_rows + ks[None, :] * x_k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        b = tl.load(w_cols + ks[:, None] * w_k, mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BK, BN]
        if UPCAST:  # Triton's interpreter (CPU): see matmul_triton
            a, b = a.to(tl.float32), b.to(tl.float32)
            acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)  # each element's k in order, row by row
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm.to(tl.int64)[:, None] * o_m + rn[None, :] * o_n
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _rms_norm_kernel(x_ptr, out_ptr, N, x_m, o_m, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * x_m
    o_row = out_ptr + row * o_m
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, N, BLOCK):                     # the row in fixed blocks, in order
        x = tl.load(x_row + start + cols, mask=start + cols < N, other=0.0).to(tl.float32)
        squares += x * x
    # correctly rounded divisions, as torch's; N + 0.0, not N.to(): an N of 1 arrives as a constexpr
    mean = tl.math.div_rn(tl.sum(squares, axis=0), N + 0.0)
    r = tl.math.div_rn(1.0, tl.sqrt_rn(mean + eps))
    for start in range(0, N, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < N, other=0.0).to(tl.float32)
        tl.store(o_row + start + cols, x * r, mask=start + cols < N)


@functools.cache
def _kernels():
    """(matmul, rms_norm) jit kernels, made on first use: ``import triton`` and ``triton.jit`` fix compiled or
    interpreted (``TRITON_INTERPRET``) when they run, so neither may happen at this module's import."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    return (triton.jit(_matmul_kernel, do_not_specialize=["M"]), triton.jit(_rms_norm_kernel))


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or its copy when it starts off a 16-byte line (a row sliced off a batch): Triton specialises on
    pointer alignment, so the launch must not depend on where the tensor came from."""
    return t if t.data_ptr() % _ALIGN == 0 else t.clone()


def _interpret_on_cpu(t: torch.Tensor) -> None:
    if t.device.type != "cuda":
        from kernels.dispatch import use_interpreter

        use_interpreter()


# ------------------------------------------------------------------------------------------------- wrappers


def matmul_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of ``matmul_reference``: ``[M, N]`` in x's dtype, batch-invariant (see the module's
    docstring). On a CPU it runs in Triton's interpreter."""
    _check_matmul(x, weight, bias)
    _interpret_on_cpu(x)
    x, weight = _aligned(x), _aligned(weight)
    bias = None if bias is None else _aligned(bias.contiguous())
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    cfg = MATMUL_CONFIGS[x.dtype]
    # In Triton's interpreter (a CPU) tl.dot is numpy's matmul: it reads bf16 as raw uint16 bits, and its BLAS
    # may sum a row in another order by the row's place in the tile (measured: OpenBLAS on an AMD EPYC, 6-row
    # blocks). There the tile's product is exact fp32 products summed over k in order, element by element.
    upcast = x.device.type != "cuda"
    tiles = -(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"])
    _kernels()[0][(tiles,)](
        x, weight, out if bias is None else bias, out, m, n, k,
        *x.stride(), *weight.stride(), *out.stride(),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 or upcast, UPCAST=upcast, **cfg,
    )
    return out


def rms_norm_triton(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton twin of ``rms_norm_reference``: fp32 ``[M, N]``, batch-invariant (see the module's docstring).
    On a CPU it runs in Triton's interpreter."""
    _check_rms_norm(x, eps)
    _interpret_on_cpu(x)
    x = _aligned(x.contiguous())  # rows N apart: the row stride's alignment, too, is the same for every x
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if out.numel():
        _kernels()[1][(x.shape[0],)](x, out, x.shape[1], x.stride(0), out.stride(0), float(eps),
                                     BLOCK=RMS_BLOCK, num_warps=RMS_WARPS)
    return out


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           backend: str | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T (+ bias)`` with ``backend`` ``"auto"`` (None: ``$SPECDEC_KERNELS``, else
    auto), ``"triton"`` or ``"torch"``, resolved by ``kernels.dispatch.resolve``: Triton on CUDA, the torch
    reference on a CPU unless Triton is forced (then interpreted, for tests)."""
    from kernels.dispatch import resolve

    fn = matmul_triton if resolve(backend, x.device) == "triton" else matmul_reference
    return fn(x, weight, bias)


def rms_norm(x: torch.Tensor, eps: float, backend: str | None = None) -> torch.Tensor:
    """The fp32 normalised rows of ``x [M, N]`` with ``backend`` (as ``matmul``)."""
    from kernels.dispatch import resolve

    fn = rms_norm_triton if resolve(backend, x.device) == "triton" else rms_norm_reference
    return fn(x, eps)
