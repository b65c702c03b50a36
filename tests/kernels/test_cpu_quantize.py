"""The C quantizer (kernels/csrc/quantize_cpu.c) gives the torch formulation's bits, in one call."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_quantize
from specdec.engine.quant import QuantLinear, quantize_rows

pytestmark = pytest.mark.skipif(not cpu_quantize.available(), reason="no C compiler here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("smooth", [False, True])
def test_same_bits_as_the_torch_formulation(dtype, smooth):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 576, generator=g) * 3).to(dtype)
    x[4] = 0  # an all-zero row: the floor of the scale, every q 128
    x[5, 7] = 1e4  # an outlier
    x[6, ::2] = 0.5  # exact halves after scaling exercise round-half-even
    inv = torch.rand(576, generator=g) + 0.5 if smooth else None
    q, s = cpu_quantize.quantize_rows_u8(x, inv)
    rq, rs = quantize_rows(x, inv, torch.uint8)
    assert q.dtype == torch.uint8 and s.shape == (9, 1)
    assert torch.equal(q, rq) and torch.equal(s, rs)
    assert (q[4] == 128).all()


def test_a_strided_view_is_read_in_place():
    x = torch.randn(6, 128)
    view = x[:, :64]  # row stride 128
    q, s = cpu_quantize.quantize_rows_u8(view, None)
    rq, rs = quantize_rows(view, None, torch.uint8)
    assert torch.equal(q, rq) and torch.equal(s, rs)


def test_the_product_is_the_same_with_either_quantizer():
    lin = QuantLinear(torch.randn(64, 96), smooth=torch.rand(96) + 0.5)
    x = torch.randn(5, 96)
    assert lin.fused_quantize
    fused = lin(x)
    lin.fused_quantize = False
    assert torch.equal(lin(x), fused)
