"""The fused lm_head + distillation loss against a plain reference (value and gradients)."""

from __future__ import annotations

import pytest
import torch

from specdec.distill.loss import _FusedDistillLoss


@pytest.mark.parametrize("temperature,ce_weight,softcap", [(1.0, 0.0, None), (2.0, 0.3, None), (1.0, 0.3, 5.0)])
def test_fused_loss_matches_reference(temperature, ce_weight, softcap):
    torch.manual_seed(0)
    n, h, v, k = 40, 16, 200, 8
    hid = torch.randn(n, h).bfloat16().float().requires_grad_()
    w = (torch.randn(v, h) * 0.5).bfloat16().float().requires_grad_()
    lp, ids = (torch.randn(n, v) * 2).log_softmax(-1).topk(k)
    tlp = (lp / temperature).log_softmax(-1)
    ce = torch.randint(0, v, (n,))
    loss = _FusedDistillLoss.apply(hid, w, ids, tlp.exp(), tlp, ce, ce_weight, temperature, softcap, 7, {})
    loss.backward()
    gh, gw = hid.grad.clone(), w.grad.clone()
    hid.grad = w.grad = None
    z = hid @ w.T
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    logq = (z / temperature).log_softmax(-1).gather(1, ids)
    ref = temperature ** 2 * (tlp.exp() * (tlp - logq)).sum(-1).mean()
    ref = ref + ce_weight * torch.nn.functional.cross_entropy(z, ce)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-3 * abs(ref.item())
    assert (gh - hid.grad).abs().max() < 0.02 * hid.grad.abs().max()
    assert (gw - w.grad).abs().max() < 0.02 * w.grad.abs().max()
