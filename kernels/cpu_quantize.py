"""Per-token u8 quantization of activations in one C call (``kernels/csrc/quantize_cpu.c``).

:class:`specdec.engine.quant.QuantLinear` quantizes its input rows before every int8 product. As torch
operators that is about ten dispatches and temporaries per product, ~1/4 of an int8 pass of SmolLM2-135M
(120 products); the C function computes the same bits (``tests/kernels/test_cpu_quantize.py``) in one call.
Built on first use (``kernels.cpu_build``); where that fails the torch formulation runs.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from kernels.cpu_build import KernelUnavailable, build

logger = logging.getLogger(__name__)
_I32, _I64, _P = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _function():
    """The C function, or None (logged once) where it cannot be built here."""
    try:
        fn = build("quantize_cpu", [], "CPU quantization kernel").quantize_rows_u8
    except (KernelUnavailable, OSError) as exc:
        logger.info("the C quantization kernel is unavailable (%s); int8 products quantize with torch operators", exc)
        return None
    fn.restype = _I32
    fn.argtypes = [_P, _I32, _P, _I64, _I64, _I64, _P, _P]
    return fn


def available() -> bool:
    return _function() is not None


def quantize_rows_u8(x: torch.Tensor, inv_smooth: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [m, k] u8 = int8 + 128, scale [m, 1] fp32) of the rows of ``x`` [m, k] (fp32 or bf16, CPU), each
    ``x * inv_smooth`` with its own scale max|.| / 127 (see ``specdec.engine.quant.quantize_rows``)."""
    fn = _function()
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), dtype=torch.uint8)
    scale = torch.empty((m, 1), dtype=torch.float32)
    fn(x.data_ptr(), 0 if x.dtype == torch.float32 else 1, None if inv_smooth is None else inv_smooth.data_ptr(),
       m, k, x.stride(0), q.data_ptr(), scale.data_ptr())
    return q, scale
