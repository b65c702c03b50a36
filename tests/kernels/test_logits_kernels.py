"""kernels/logits.py against its torch reference (close, not bit-exact: it is not in the decision path)."""

from __future__ import annotations

import pytest
import torch

from kernels.logits import temperature_softmax, temperature_softmax_reference
from tests.kernels.conftest import DEVICE


@pytest.mark.parametrize("rows, vocab", [(5, 100), (3, 49152), (1, 262_144)])
def test_temperature_softmax_matches_reference(rows, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 5).to(DEVICE)
    logits[0, : vocab // 3] = float("-inf")  # masked ids (a draft vocabulary, padding)
    t = torch.linspace(0.3, 1.7, rows).to(DEVICE)
    got, ref = temperature_softmax(logits, t), temperature_softmax_reference(logits, t)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)
    assert bool((got[0, : vocab // 3] == 0).all())
