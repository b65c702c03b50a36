"""Quantized products for the lean forward: W8A8 int8 (CPU and CUDA) and fp8 (CUDA, compute capability 8.9+).

A decoder pass over a few tokens reads every weight once, so its cost follows the weights' bytes. int8
weights are a quarter of fp32's, and with int8 activations too the product runs on the integer units (AMX or
VNNI on x86, IMMA on NVIDIA). Measured on 2 cores (the 120 decoder products of SmolLM2-135M, torch 2.13,
2 threads, best of 7; see ``benchmarks/bench_quantization.py`` for whole passes):

* AMD EPYC, avx2 only (from the quantization issue): fp32 ``F.linear`` 38-83 ms for 1-16 rows, bf16 22-32,
  int8 ``torch._int_mm`` with per-token activations 15-38; torch's weight-only int8/int4 kernels 59-1655 ms,
  which is not a path on CPU.
* AMD EPYC with avx512 (VNNI, bf16), no AMX (this session's machine): ``torch._int_mm`` reads its int8 weight
  3.7x faster as a transposed view of the ``[out, in]`` matrix than as a contiguous ``[in, out]`` one (13 vs
  48 us for the 3,072 x 576 gate|up product, one row), but reorders it on every call: 3.8 ms for the 120
  products at one row, ~10 ms at 2-16 rows. oneDNN's int8 product on a weight packed once
  (:func:`onednn_pack`) takes 4.9 ms at one row and 6.6 ms at 16, so that is the CPU path; ``_int_mm`` is
  the fallback. ``torch._scaled_mm`` on fp8 runs on CPU but ~100x slower than int8: fp8 is a CUDA mode only.
  Without VNNI or AMX oneDNN's int8 kernel saturates its int16 pair sums (:func:`onednn_int8_is_exact`), so a
  CPU like the first one runs ``_int_mm``: the path is chosen by a probe of exactness, not by the CPU's name.

The scheme (what SmoothQuant and vLLM's ``w8a8`` int8 use): weights int8 per output channel (symmetric,
scale = max |w| / 127 of the row), activations int8 per token (each row's own scale, computed in the pass),
int32 accumulation, the two scales applied after. Optionally a per-input-channel smoothing vector ``s``
(SmoothQuant): the weight's columns are multiplied by ``s`` and the activations divided by it, which moves
activation outliers into the weights, where per-channel scales absorb them (``specdec.engine.quant_plan``
calibrates ``s``).

**Batch invariance comes for free**: an int8 x int8 product accumulated in int32 is exact, so its result does
not depend on the kernel, the blocking or the order of the sum, and the per-row scales involve only that row.
A row's output is the same bits in any pass whatever its shape (``tests/specdec/engine/test_quant.py``),
without the fixed-tile products the fp formulations need (:mod:`specdec.engine.lean_linear`).
"""

from __future__ import annotations

import functools

import torch

from kernels import cpu_quantize
from specdec.config import QUANTIZATIONS
_FP8 = getattr(torch, "float8_e4m3fn", None)
_FP8_MAX = 448.0


def quantization_unavailable(quantization: str, device: torch.device | str) -> str | None:
    """Why ``quantization`` cannot run on ``device`` (None: it can)."""
    device = torch.device(device)
    if quantization not in QUANTIZATIONS:
        return f"unknown quantization {quantization!r}; use one of {list(QUANTIZATIONS)}"
    if quantization == "fp8":
        if device.type != "cuda":
            return "fp8 runs on CUDA only (torch's fp8 product on CPU is ~100x slower than int8: use int8)"
        if _FP8 is None or torch.cuda.get_device_capability(device) < (8, 9):
            return "fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper): use int8"
    if quantization == "int8" and device.type not in ("cpu", "cuda"):
        return f"no int8 products on {device.type}"
    return None


def quantize_weight(weight: torch.Tensor, smooth: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [out, in] int8 or fp8, scale [out] fp32): ``weight * smooth`` per output row, symmetric."""
    w = weight.detach().float()
    if smooth is not None:
        w = w * smooth.float()
    peak = w.abs().amax(dim=1).clamp_min(1e-12)
    if dtype == torch.int8:
        scale = peak / 127.0
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    else:
        scale = peak / _FP8_MAX
        q = (w / scale[:, None]).clamp_(-_FP8_MAX, _FP8_MAX).to(dtype)
    return q.contiguous(), scale


def quantize_rows(x: torch.Tensor, inv_smooth: torch.Tensor | None = None,
                  dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [m, in], scale [m, 1] fp32): each row of ``x * inv_smooth`` with its own symmetric scale."""
    xs = x.float()
    if inv_smooth is not None:
        xs = xs * inv_smooth
    peak = xs.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12)
    if dtype == torch.int8:
        scale = peak / 127.0
        return torch.round(xs / scale).clamp_(-127, 127).to(torch.int8), scale
    if dtype == torch.uint8:  # the same int8 values + 128 (oneDNN's u8 activations with zero point 128)
        scale = peak / 127.0
        return torch.round(xs / scale).clamp_(-127, 127).add_(128).to(torch.uint8), scale
    scale = peak / _FP8_MAX
    return (xs / scale).clamp_(-_FP8_MAX, _FP8_MAX).to(dtype), scale


def onednn_pack(q: torch.Tensor) -> torch.Tensor | None:
    """``q`` [out, in] int8 reordered for oneDNN's int8 product, or None where this torch lacks it.

    ``torch._int_mm`` reorders its weight on every call: measured here (AMD EPYC, avx512 VNNI), the 120 decoder
    products of SmolLM2 take 3.8 ms for one row but ~10 ms for 2-16 rows; prepacked (``onednn::qlinear_pointwise``,
    what torch's compiler uses for x86 int8 linears) 4.9 ms for one row, 6.6 ms for 16. Its fast kernels take
    u8 activations (s8 ones run a reference path, ~200x slower), hence the zero point of 128. The sums are
    exact int32 either way (each path batch-invariant); the two apply the scales in another order.
    """
    if not onednn_int8_is_exact():
        return None
    try:
        return _prepack(q)
    except (RuntimeError, AttributeError):
        return None


def _prepack(q: torch.Tensor) -> torch.Tensor:
    return torch.ops.onednn.qlinear_prepack(q, [4, q.shape[1]])


def _onednn_product(xq: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                    zero_points: torch.Tensor) -> torch.Tensor:
    return torch.ops.onednn.qlinear_pointwise(xq, 1.0, 128, packed, scale, zero_points, None, 1.0, 0,
                                              torch.float32, "none", [], "")


@functools.cache
def onednn_int8_is_exact() -> bool:
    """Whether oneDNN's u8 x s8 product sums exactly on this CPU (checked once per process).

    With VNNI (avx512_vnni, avx_vnni) or AMX it does. Without them (AMD EPYC with avx2 only, measured) its
    kernel adds pairs of u8 x s8 products in int16 (``vpmaddubsw``), which saturates for large activations
    (u8 = value + 128): a product of random rows was 9.4% off the float one where ``torch._int_mm`` is 0.9%
    off and exact in int32. Such a CPU uses ``_int_mm``. The probe uses the values that saturate: every
    activation at the top of the range against weights of +-127.
    """
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randint(-127, 128, (16, 64), generator=g, dtype=torch.int8)
        q[:, :8] = 127
        x = torch.randint(0, 256, (3, 64), generator=g, dtype=torch.uint8)
        x[0] = 255
        got = _onednn_product(x, _prepack(q), torch.ones(16), torch.zeros(16, dtype=torch.long))
    except (RuntimeError, AttributeError):
        return False
    exact = (x.double() - 128) @ q.double().t()
    return bool(torch.equal(got.double(), exact))


class QuantLinear:
    """``F.linear(x, weight, bias)`` as a W8A8 product (int8, or fp8 on CUDA): see the module.

    Built from the float weight (quantized here) or from ``q`` and ``scale`` made earlier (a cache).
    ``smooth``: the SmoothQuant vector of the input channels (None: none). Called like ``LeanLinear``.
    """

    def __init__(self, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 smooth: torch.Tensor | None = None, kind: str = "int8",
                 q: torch.Tensor | None = None, scale: torch.Tensor | None = None):
        if kind not in ("int8", "fp8"):
            raise ValueError(f"QuantLinear kind must be int8 or fp8, got {kind!r}")
        self.kind = kind
        self.qdtype = torch.int8 if kind == "int8" else _FP8
        if q is None:
            if weight is None:
                raise ValueError("QuantLinear needs a weight, or q and scale")
            q, scale = quantize_weight(weight, smooth, self.qdtype)
        self.q = q  # [out, in]: passed to the product as .t(), a column-major [in, out] (the fast layout)
        self.scale = scale.float().view(1, -1)  # [1, out]
        self.smooth = None if smooth is None else smooth.float()
        self.inv_smooth = None if smooth is None else (1.0 / self.smooth).view(1, -1).contiguous()
        self.bias = bias
        self.out_features = int(q.shape[0])
        self.in_features = int(q.shape[1])
        self.packed = onednn_pack(q) if kind == "int8" and q.device.type == "cpu" else None
        self._zero_points = torch.zeros(self.out_features, dtype=torch.long) if self.packed is not None else None
        # one C call (kernels.cpu_quantize) quantizes a pass's rows for either CPU product
        self.fused_quantize = kind == "int8" and q.device.type == "cpu" and cpu_quantize.available()

    def drop_unpacked(self) -> None:
        """Let go of ``q`` where the product reads only the packed copy (oneDNN on CPU); call once the plan's
        cache is written (``QuantPlan.tensors`` reads ``q``)."""
        if self.packed is not None:
            self.q = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        if self.packed is not None:  # oneDNN, weight prepacked: activations u8 = q + 128 (zero point 128)
            if self.fused_quantize and rows.dtype in (torch.float32, torch.bfloat16):
                xq, xscale = cpu_quantize.quantize_rows_u8(rows, self.inv_smooth)
            else:
                xq, xscale = quantize_rows(rows, self.inv_smooth, torch.uint8)
            out = _onednn_product(xq, self.packed, self.scale[0], self._zero_points) * xscale
            if self.bias is not None:
                out = out + self.bias
            return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        if self.fused_quantize and rows.dtype in (torch.float32, torch.bfloat16) and rows.device.type == "cpu":
            xq, xscale = cpu_quantize.quantize_rows_u8(rows, self.inv_smooth)
            xq = xq.view(torch.int8).bitwise_xor_(-128)  # u8 = value + 128: flipping the top bit gives the value
        else:
            xq, xscale = quantize_rows(rows, self.inv_smooth, self.qdtype)
        if x.device.type == "cuda":  # cuBLASLt: int8 wants more than 16 rows, fp8 rows a multiple of 16
            pad = max(32, -(-n // 16) * 16) - n
            if pad:
                xq = torch.cat([xq, xq.new_zeros((pad, xq.shape[1]))])
                xscale = torch.cat([xscale, xscale.new_ones((pad, 1))])
        if self.kind == "fp8":  # row-wise scales: bf16 out (what cuBLASLt supports with them)
            out = torch._scaled_mm(xq, self.q.t(), scale_a=xscale, scale_b=self.scale, out_dtype=torch.bfloat16)[:n]
        else:
            out = torch._int_mm(xq, self.q.t())[:n].float() * xscale[:n] * self.scale
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
