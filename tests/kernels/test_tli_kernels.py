"""kernels/tli.py against its torch reference (specdec/tli/vocab_mapping.py): bit-identical, as data movement is."""

from __future__ import annotations

import pytest
import torch

from kernels.tli import mask_ids as triton_mask
from kernels.tli import scatter_ids as triton_scatter
from specdec.tli.id_maps import mask_ids, scatter_ids
from tests.kernels.conftest import DEVICE


@pytest.mark.parametrize("v_src, size, fill", [(100, 120, 0.0), (49152, 262_144, float("-inf")), (262_144, 49152, 0.0)])
def test_scatter_matches_reference(v_src, size, fill):
    g = torch.Generator().manual_seed(v_src)
    n = min(v_src, size) // 2
    src_ids = torch.randperm(v_src, generator=g)[:n].sort().values
    dst_ids = torch.randperm(size, generator=g)[:n]
    for shape in [(v_src,), (3, v_src)]:
        src = torch.randn(*shape, generator=g).to(DEVICE)
        a = scatter_ids(src, src_ids.to(DEVICE), dst_ids.to(DEVICE), size, fill)
        b = triton_scatter(src, src_ids.to(DEVICE), dst_ids.to(DEVICE), size, fill)
        assert a.shape == b.shape == (*shape[:-1], size)
        assert torch.equal(a, b)


@pytest.mark.parametrize("vocab, keep_len", [(100, 100), (1000, 900), (262_144, 262_144)])
def test_mask_matches_reference(vocab, keep_len):
    g = torch.Generator().manual_seed(vocab)
    keep = torch.rand(keep_len, generator=g) < 0.3
    for shape in [(vocab,), (2, vocab)]:
        x = torch.randn(*shape, generator=g).to(DEVICE)
        a = mask_ids(x, keep.to(DEVICE), float("-inf"))
        b = triton_mask(x, keep.to(DEVICE), float("-inf"))
        assert torch.equal(a, b)
        if keep_len < vocab:  # ids past the mask are masked
            assert bool(torch.isinf(b[..., keep_len:]).all())


def test_adapter_routes_through_the_chosen_kernels(monkeypatch):
    """TLIAdapter.q_to_target / restrict call the backend's functions (Triton here) and match torch's."""
    import kernels.tli
    from specdec.tli.adapter import TLIAdapter
    from specdec.tli.vocab_mapping import VocabMapping

    d2t = torch.tensor([2, -1, 0, 5, -1, 3])
    t2d = torch.full((8,), -1, dtype=torch.long)
    t2d[d2t[d2t >= 0]] = torch.nonzero(d2t >= 0).squeeze(1)
    mapping = VocabMapping(d2t, t2d, 4, 6, 8, "draft", "target")
    adapter = TLIAdapter.__new__(TLIAdapter)  # only the mapping's parts: no tokenizers needed
    adapter.mapping, adapter.target_vocab_size, adapter._pairs = mapping, 8, {}
    calls = []
    real = kernels.tli.scatter_ids
    monkeypatch.setattr(kernels.tli, "scatter_ids", lambda *a: calls.append("scatter") or real(*a))
    q = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.0, 0.4]).to(DEVICE)
    adapter.kernels = "torch"
    ref_q, ref_r = adapter.q_to_target(q), adapter.restrict(q)
    adapter.kernels = "triton"
    assert torch.equal(adapter.q_to_target(q), ref_q) and calls == ["scatter"]
    assert torch.equal(adapter.restrict(q), ref_r)
    assert ref_q.tolist() == pytest.approx([0.2, 0, 0.1, 0.4, 0, 0.3, 0, 0])
