"""specdec.engine.lean_linear: every formulation a lean product may pick computes F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.engine import lean_linear
from specdec.engine.lean_linear import LeanLinear, pack


def _weights(out_features: int, dtype: torch.dtype, bias: bool):
    g = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, 48, generator=g).to(dtype)
    return w, (torch.randn(out_features, generator=g).to(dtype) if bias else None)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("use_onednn", [True, False])
def test_lean_linear_equals_f_linear(rows, dtype, bias, use_onednn):
    w, b = _weights(40, dtype, bias)
    lin = LeanLinear(w, b, use_onednn=use_onednn)
    assert (lin.packed is not None) == (use_onednn and pack(w) is not None)
    x = torch.randn(2, rows, 48).to(dtype)  # [batch, rows, in]: the decoder's shape
    with torch.inference_mode():
        got, ref = lin(x), F.linear(x, w, b)
    assert got.shape == (2, rows, 40) and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, ref, **tol)


def test_fp32_few_rows_take_the_skinny_product_and_more_rows_onednn(monkeypatch):
    """The measured choice: fp32 products of up to ``skinny_max_rows`` rows read the plain weight, larger ones
    (and bf16 ones) the packed copy."""
    w, _ = _weights(40, torch.float32, False)
    lin = LeanLinear(w)
    if lin.packed is None:
        pytest.skip("oneDNN is unavailable in this torch build")
    calls = []
    monkeypatch.setattr(lean_linear, "skinny_linear", lambda x, w, b: calls.append(("skinny", x.shape)) or F.linear(x, w, b))
    with torch.inference_mode():
        for rows in range(1, 6):
            lin(torch.randn(1, rows, 48))
    assert [c[1][1] for c in calls] == list(range(1, LeanLinear.skinny_max_rows + 1))
    blin = LeanLinear(w.bfloat16())
    # bf16 keeps only the packed copy where oneDNN packs bf16 (avx512_bf16/AMX); elsewhere only the plain one
    assert (blin.weight is None) == (blin.packed is not None) == lean_linear._onednn_ok(torch.bfloat16)
    with torch.inference_mode():
        blin(torch.randn(1, 1, 48).bfloat16())
    assert len(calls) == LeanLinear.skinny_max_rows


def test_pack_declines_what_onednn_does_not_take():
    assert pack(torch.randn(8, 4).half()) is None
    assert pack(torch.randn(8, 4, dtype=torch.float64)) is None
