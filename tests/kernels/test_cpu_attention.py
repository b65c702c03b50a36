"""kernels/cpu_attention.py: the batch-invariant C kernel against the torch reference, and bitwise invariance:
a query's output is the same bits alone (a decode), in a window of its sequence, beside other sequences and
with any thread count. The pools are the NaN-filled strided views of tests/kernels/test_paged_attention.py,
so a read of a slot the sequence does not own shows."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_attention
from kernels.cpu_attention import CHUNK, paged_attention_cpu
from kernels.paged_attention import paged_attention_reference
from tests.kernels.test_paged_attention import TOL, make_case

ok, why = cpu_attention.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"the CPU kernel cannot be built here: {why}")

# (new tokens, keys including them): decodes, windows, a prefill, contexts across the chunk boundaries
SEQS = [(1, 1), (3, 17), (1, CHUNK), (4, CHUNK + 2), (40, 2 * CHUNK + 30), (1, 3 * CHUNK + 1)]


def _cpu(args, window, threads=None):
    return paged_attention_cpu(*args, window=window, threads=threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 1, 8, CHUNK + 100])
@pytest.mark.parametrize("kv_heads, dim", [(2, 16), (1, 64), (2, 20)])
def test_matches_the_reference(dtype, window, kv_heads, dim):
    args, _ = make_case(16, 4, kv_heads, dim, dtype, seqs=SEQS, device="cpu")
    want = paged_attention_reference(*args, window=window)
    got = _cpu(args, window)
    assert got.dtype == dtype and got.shape == want.shape
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def _alone(args, seqs, window):
    """Each query as a one-token decode of its own sequence (its keys up to itself), one at a time."""
    q, k_pool, v_pool, tables, ctx, qsl, bs, scale = args
    out, t = [], 0
    for s, (n, c) in enumerate(seqs):
        for j in range(n):
            out.append(paged_attention_cpu(q[t: t + 1], k_pool, v_pool, tables[s: s + 1],
                                           torch.tensor([c - n + j + 1], dtype=torch.int32),
                                           torch.tensor([0, 1], dtype=torch.int32), bs, scale, window=window,
                                           threads=1)[0])
            t += 1
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 300])
def test_a_query_gives_the_same_bits_in_any_pass(dtype, window):
    args, _ = make_case(16, 6, 2, 64, dtype, seqs=SEQS, device="cpu")
    alone = _alone(args, SEQS, window)
    for threads in (1, 2, 3):
        assert torch.equal(_cpu(args, window, threads), alone), f"{threads} threads"
    # one sequence's window on its own, then beside other sequences in another order
    q, k_pool, v_pool, tables, ctx, qsl, bs, scale = args
    s = 4  # 40 new tokens across a chunk boundary
    start, n = int(qsl[s]), SEQS[s][0]
    for threads in (1, 2, 4):  # few items (2 kv heads x its chunks): its queries are split among the threads
        own = paged_attention_cpu(q[start: start + n], k_pool, v_pool, tables[s: s + 1], ctx[s: s + 1],
                                  torch.tensor([0, n], dtype=torch.int32), bs, scale, window=window, threads=threads)
        assert torch.equal(own, alone[start: start + n]), f"{threads} threads"
    order = [5, 4, 0, 2]
    rows = torch.cat([torch.arange(int(qsl[i]), int(qsl[i + 1])) for i in order])
    starts = torch.tensor([0] + [SEQS[i][0] for i in order]).cumsum(0).to(torch.int32)
    mixed = paged_attention_cpu(q[rows], k_pool, v_pool, tables[order], ctx[order], starts, bs, scale,
                                window=window, threads=2)
    assert torch.equal(mixed, alone[rows])


def test_torch_attention_is_not_invariant_so_the_test_above_can_fail():
    """The negative control: the same check on the torch reference (softmax over all of a window's keys at
    once, masked) finds differing bits, so bitwise equality above is a property of the kernel."""
    args, _ = make_case(16, 6, 2, 64, torch.bfloat16, seqs=SEQS, device="cpu")
    q, k_pool, v_pool, tables, ctx, qsl, bs, scale = args
    alone = torch.cat([paged_attention_reference(
        q[t: t + 1], k_pool, v_pool, tables[s: s + 1], torch.tensor([c - n + j + 1], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32), bs, scale)
        for t, (s, (n, c), j) in enumerate((s, sc, j) for s, sc in enumerate(SEQS) for j in range(sc[0]))])
    assert not torch.equal(paged_attention_reference(*args), alone)


def test_rejects_what_it_cannot_read():
    args, _ = make_case(16, 4, 2, 16, torch.float16, seqs=[(1, 3)], device="cpu")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        paged_attention_cpu(*args)
    args, _ = make_case(16, 3, 2, 16, torch.float32, seqs=[(1, 3)], device="cpu")
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_attention_cpu(*args)


def test_empty_pass():
    args, _ = make_case(16, 4, 2, 16, torch.float32, seqs=[(1, 3)], device="cpu")
    q = args[0][:0]
    out = paged_attention_cpu(q, *args[1:3], args[3][:0], args[4][:0], torch.zeros(1, dtype=torch.int32),
                              *args[6:])
    assert out.shape == (0, 4, 16)


def test_without_a_compiler_it_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, gcc or clang either
    cpu_attention._library.cache_clear()
    try:
        ok, why = cpu_attention.available()
        assert not ok and "no C compiler" in why
    finally:
        cpu_attention._library.cache_clear()
