"""The lean forward's matrix products: each projection picks the fastest formulation for its row count.

A decoder pass over a few tokens is bound by reading the weights, so scoring 3-5 tokens should cost about
what one token costs. On CPU it does not with one formulation for every row count. Measured on 2 AVX-512
cores (AMD EPYC, no AMX; torch 2.13: MKL 2024.2, oneDNN 3.12), weights cold in cache as in a real pass,
milliseconds per product at 1 thread (2 threads rank the formulations the same way; the gate|up
projection, 3,072 x 576, too: fp32 skinny 0.38 / 0.37 / 0.52 / 0.66 ms for 1 / 2 / 3 / 5 rows, oneDNN 0.56 /
0.74 / 0.60 / 0.48):

============================  ======  ======  ======  ======  =======
SmolLM2's 49,152 x 576 head   1 row   2 rows  3 rows  5 rows  16 rows
============================  ======  ======  ======  ======  =======
fp32 ``F.linear`` (MKL)        11.7    27.7    43.1    21.5    28.1
fp32 ``w @ x.T`` (skinny)       6.2     6.7     8.6    10.9    32.4
fp32 oneDNN, packed weight      8.5    10.7     7.9     7.1    12.2
bf16 ``F.linear``               9.2     7.7     7.6     8.9    11.6
bf16 oneDNN, packed weight      5.5     4.9     4.2     4.0     7.4
============================  ======  ======  ======  ======  =======

The decoder's own projections rank about the same way (at 3 rows skinny and oneDNN are close product by
product; a whole fp32 SmolLM2 pass of 3 tokens took 46 ms with oneDNN there, 63 ms with skinny). So: fp32 products of 1-2 rows run as
:func:`specdec.engine.models.skinny_linear`, and of 3 rows or more, and every bf16 product, through oneDNN on a weight
reordered once into its blocked layout (``torch.ops.mkldnn``, what torch's own compiler uses for frozen CPU
linears). The reordered copy costs the weight's size again in memory. Where oneDNN is missing or refuses the
weight, and on other devices, the products stay ``F.linear`` / ``skinny_linear``; results differ from
``F.linear`` only by summation order.

**Batch-invariant products** (``tile_rows``, ``--batch-invariant``): the formulation above is chosen by row
count, and every library product picks its kernel, blocking and thread split by its shape (measured here:
oneDNN's fp32 product over 1,536 inputs, and its bf16 products past 32 rows, change a row's last bits with the
row count; MKL's ``F.linear`` does from 2 rows). So a row's result would depend on what else is in the pass.
With ``tile_rows = T`` every product is made of calls of exactly T rows (the last tile padded with zeros),
one formulation for all (oneDNN where available, else ``F.linear``; on CUDA the fixed-tile Triton kernel
``kernels.batch_invariant.matmul``): the library sees one shape per weight, so one kernel and one reduction
order per output element, and rows never mix in a product. A row's output is then the same bits at any place
in any pass (``tests/specdec/engine/test_batch_invariance.py`` checks it bitwise). The cost: a pass of more
than T rows reads the weights once per tile.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F


logger = logging.getLogger(__name__)

_PACK_DTYPES = (torch.float32, torch.bfloat16)
INVARIANT_TILE_ROWS = 16  # batch-invariant products: rows per call (one AMX tile; a pass of 1-16 rows: one call per product)


def _onednn_ok(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [out, in] reordered for oneDNN's matmul, or None where that is unavailable here."""
    if weight.device.type != "cpu" or weight.dtype not in _PACK_DTYPES or not _onednn_ok(weight.dtype):
        return None
    try:
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 4)  # 4: a few-row batch hint
            probe = weight.new_zeros((3, weight.shape[1]))  # one product, so a refusal shows here, not mid-pass
            torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        return packed
    except (RuntimeError, AttributeError) as exc:  # an op missing from this torch build, or a refused layout
        logger.info("oneDNN matmuls unavailable (%s: %s); the lean forward uses F.linear", type(exc).__name__, exc)
        return None


class LeanLinear:
    """``F.linear(x, weight, bias)`` with the formulation that is fastest for ``x``'s row count (see the module).

    ``packed`` is the weight's oneDNN copy; ``weight`` the plain tensor, kept where a product may read it
    (fp32: products of 1-2 rows; anywhere without a packed copy), else dropped.
    """

    skinny_max_rows = 2  # fp32: up to this many rows, w @ x.T beats oneDNN (1 and 2 threads, measured)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, use_onednn: bool = True,
                 tile_rows: int | None = None):
        self.bias = bias
        self.packed = pack(weight) if use_onednn else None
        self.tile_rows = tile_rows  # batch-invariant: products of exactly this many rows (see the module)
        keep = self.packed is None or (weight.dtype == torch.float32 and not tile_rows) or weight.device.type != "cpu"
        self.weight: torch.Tensor | None = weight if keep else None
        self.out_features = int(weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_rows:
            return self._tiled(x)
        if self.packed is not None and (x.dtype != torch.float32 or x.numel() > self.skinny_max_rows * x.shape[-1]):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if x.device.type == "cpu" and x.dtype == torch.float32:
            return skinny_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        """The product as calls of exactly ``tile_rows`` rows: one shape, so one kernel for every row."""
        t = self.tile_rows
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        if x.device.type == "cuda":  # one fixed tile configuration for any row count, by construction
            from kernels.batch_invariant import matmul

            return matmul(rows, self.weight, self.bias).view(*x.shape[:-1], self.out_features)
        if n % t:
            rows = torch.cat([rows, rows.new_zeros((t - n % t, rows.shape[1]))])
        if self.packed is not None:
            outs = [torch.ops.mkldnn._linear_pointwise(tile, self.packed, self.bias, "none", [], "")
                    for tile in rows.split(t)]
        else:
            outs = [F.linear(tile, self.weight, self.bias) for tile in rows.split(t)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # a pass of up to t rows: no copy
        return out[:n].view(*x.shape[:-1], self.out_features)


class SkinnyLinear(torch.nn.Linear):
    """``nn.Linear`` whose few-row fp32 CPU products run as ``weight @ x.T``.

    Measured on 2 AVX-512 cores (torch 2.13, MKL): ``F.linear`` of 1-5 rows takes a slow path. Gemma-3's
    262,144 x 640 vocabulary projection costs 75 ms for one row and 121-150 ms for 2-5 rows, while the
    same product as ``weight @ x.T`` costs 27-52 ms (one row is fed twice: a matrix-vector product takes
    the slow path too). The decoder's own products: a whole one-token pass gains ~25%, 2-8 rows tie or gain. bf16, many rows and other devices
    keep ``F.linear``. The result differs from ``F.linear`` only by fp32 summation order.
    """

    big_out_features = 16384  # vocabulary projections: the skinny product wins for up to 64 rows
    max_rows_big = 64
    rows_small = (1, 8)  # decoder projections: it wins or ties for 1-8 rows (one row fed twice)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, self.weight, self.bias)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)``, as ``w @ x.T`` where that is faster (see :class:`SkinnyLinear`)."""
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    big = w.shape[0] >= SkinnyLinear.big_out_features
    rows_small = SkinnyLinear.rows_small
    if (x.dtype != torch.float32 or w.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled()
            or not (1 <= m <= SkinnyLinear.max_rows_big if big else rows_small[0] <= m <= rows_small[1])):
        return torch.nn.functional.linear(x, w, bias)
    rows = x.reshape(m, x.shape[-1])
    if m == 1:
        rows = torch.cat([rows, rows])
    out = torch.mm(w, rows.t()).t()[:m]
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*x.shape[:-1], w.shape[0])


def use_skinny_matmuls(model: torch.nn.Module) -> int:
    """Switch a CPU fp32 model's ``nn.Linear`` layers to :class:`SkinnyLinear` (same parameters, same
    state dict); returns how many were switched. Call after loading, for inference."""
    n = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = SkinnyLinear
            n += 1
    return n
