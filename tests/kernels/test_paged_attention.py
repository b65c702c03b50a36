"""kernels/paged_attention.py: the torch reference against plain SDPA on each sequence's contiguous keys, and the
Triton kernel (interpreted on a CPU, compiled on CUDA: tests/kernels/conftest.py) against the reference.

The pool is a strided view (dim 0 not contiguous) filled with NaN except the slots the sequences own, the block
tables are scattered and their padding points at other sequences' blocks, so a read of a wrong slot shows.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.paged_attention import paged_attention, paged_attention_reference, paged_attention_triton
from tests.kernels.conftest import DEVICE

SEQS = [(1, 1), (2, 15), (5, 16), (1, 17), (20, 70)]  # (new tokens, keys including them)


def make_case(block_size, heads, kv_heads, dim, dtype, seed=0, seqs=SEQS, device=DEVICE):
    """Random q and a pool holding each sequence's keys through a scattered block table.

    Returns (args for the kernels, per-sequence contiguous (k, v) [kv_heads, ctx, dim] as written)."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(ctx / block_size) for _, ctx in seqs]
    num_blocks = sum(need) + 3
    physical = torch.randperm(num_blocks, generator=g)  # non-consecutive, out of order
    tables = torch.randint(0, num_blocks, (len(seqs), max(need) + 2), generator=g, dtype=torch.int32)  # padding
    slots = num_blocks * block_size
    storage = torch.full((kv_heads, 2, slots, dim), float("nan"), dtype=dtype)  # k and v interleaved per kv head
    k_pool, v_pool = storage[:, 0], storage[:, 1]  # [kv_heads, slots, dim], stride(0) = 2 * slots * dim
    kvs, used = [], 0
    for s, (_, ctx) in enumerate(seqs):
        tables[s, : need[s]] = physical[used: used + need[s]].to(torch.int32)
        used += need[s]
        k = torch.randn(kv_heads, ctx, dim, generator=g).to(dtype)
        v = torch.randn(kv_heads, ctx, dim, generator=g).to(dtype)
        pos = torch.arange(ctx)
        rows = tables[s, pos // block_size].long() * block_size + pos % block_size
        k_pool[:, rows], v_pool[:, rows] = k, v
        kvs.append((k, v))
    tokens = sum(n for n, _ in seqs)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + [n for n, _ in seqs], dtype=torch.int32).cumsum(0).to(torch.int32)
    ctx = torch.tensor([c for _, c in seqs], dtype=torch.int32)
    storage, qkv = storage.to(device), qkv.to(device)  # then the views: .to() would make them contiguous
    q = qkv[:, :heads]  # [tokens, heads, dim], a strided view as a fused projection leaves it
    args = [q, storage[:, 0], storage[:, 1], tables.to(device), ctx.to(device), qsl.to(device), block_size,
            dim ** -0.5]
    return args, kvs


def sdpa_per_query(args, kvs, window, seqs=SEQS):
    """Each query alone through F.scaled_dot_product_attention over the keys it may see (fp32, GQA built in)."""
    q, scale = args[0].cpu().float(), args[7]
    out, t = torch.empty_like(q), 0
    for (n, ctx), (k, v) in zip(seqs, kvs):
        for j in range(n):
            pos = ctx - n + j
            lo = 0 if window is None else max(0, pos - window + 1)
            keys, values = k[:, lo: pos + 1].float(), v[:, lo: pos + 1].float()  # [kv_heads, seen, dim]
            out[t] = F.scaled_dot_product_attention(q[t][:, None], keys, values, scale=scale, enable_gqa=True)[:, 0]
            t += 1
    return out


TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("window", [None, 1, 8, 100])
@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("block_size", [16, 8])
def test_reference_matches_sdpa(block_size, kv_heads, window, dtype):
    args, kvs = make_case(block_size, 4, kv_heads, 16, dtype, seed=block_size + kv_heads)
    got = paged_attention_reference(*args, window=window)
    assert got.dtype == dtype and got.shape == args[0].shape
    assert not got.isnan().any()
    torch.testing.assert_close(got.cpu().float(), sdpa_per_query(args, kvs, window), **TOL[dtype])


@pytest.mark.heavy
@pytest.mark.parametrize("block_size, kv_heads, window, dtype", [
    (16, 2, None, torch.float32),
    (8, 1, None, torch.float32),
    (16, 1, 8, torch.float32),
    (8, 2, 8, torch.float32),
    (8, 2, None, torch.bfloat16),
    (16, 1, 8, torch.bfloat16),
    (16, 2, None, torch.float16),
])
def test_triton_matches_reference(block_size, kv_heads, window, dtype):
    args, _ = make_case(block_size, 4, kv_heads, 16, dtype, seed=7 * block_size + kv_heads)
    got = paged_attention_triton(*args, window=window)
    ref = paged_attention_reference(*args, window=window)
    assert got.dtype == dtype and got.shape == args[0].shape
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), ref.float(), **TOL[dtype])


def test_triton_odd_sizes():
    """A head dim and a block size that are not powers of two (masked lanes), a window cutting a block, and a
    pure prefill next to a sequence with no new tokens."""
    seqs = [(3, 3), (0, 9), (4, 30)]
    args, kvs = make_case(12, 6, 3, 20, torch.float32, seed=3, seqs=seqs)
    got = paged_attention_triton(*args, window=7)
    torch.testing.assert_close(got.cpu(), sdpa_per_query(args, kvs, 7, seqs), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got, paged_attention_reference(*args, window=7), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 20])
def test_split_keys_one_program_per_split_then_a_merge_is_the_same_bits(window, monkeypatch):
    """Flash-decoding: with splits of 16 keys (several per query), the pass run as one program per (token, head,
    split) and a merge program equals the one-program pass bit for bit, and both the reference."""
    import kernels.paged_attention as pa

    monkeypatch.setattr(pa, "SPLIT_KEYS", 16)
    seqs = [(1, 1), (2, 41), (3, 33)]  # up to 3 splits per query
    args, kvs = make_case(8, 4, 2, 16, torch.float32, seed=5, seqs=seqs)
    split = paged_attention_triton(*args, window=window, parallel=True)
    whole = paged_attention_triton(*args, window=window, parallel=False)
    assert torch.equal(split, whole)
    torch.testing.assert_close(split.cpu(), sdpa_per_query(args, kvs, window, seqs), atol=2e-5, rtol=1e-5)
    monkeypatch.setattr(pa, "SPLIT_KEYS", 512)  # one split per query: the same bits as ever
    assert torch.equal(paged_attention_triton(*args, window=window, parallel=True),
                       paged_attention_triton(*args, window=window, parallel=False))


def test_dispatch(monkeypatch):
    import kernels.paged_attention as pa

    monkeypatch.delenv("SPECDEC_KERNELS", raising=False)
    args, _ = make_case(8, 4, 2, 16, torch.float32, seqs=[(2, 10), (1, 3)])
    ref = paged_attention_reference(*args)
    torch.testing.assert_close(paged_attention(*args, backend="triton"), ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(paged_attention(*args, backend="torch"), ref)
    chosen = []
    monkeypatch.setattr(pa, "paged_attention_triton", lambda *a: chosen.append("triton") or ref)
    monkeypatch.setattr(pa, "paged_attention_reference", lambda *a: chosen.append("torch") or ref)
    pa.paged_attention(*args)
    assert chosen == ["triton" if DEVICE == "cuda" else "torch"]


def test_rejects_bad_shapes():
    args, _ = make_case(8, 4, 2, 16, torch.float32, seqs=[(1, 3)])
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_attention_reference(args[0][:, :3], *args[1:])
    with pytest.raises(ValueError, match="whole blocks"):
        paged_attention_reference(*args[:6], 7, args[7])
    with pytest.raises(ValueError, match="window"):
        paged_attention_triton(*args, window=0)


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter is a CPU matter")
def test_importable_before_the_interpreter_is_chosen():
    """The engine imports this module for the reference; forcing Triton on a CPU afterwards must still work
    (nothing of triton is imported or jit-decorated at import)."""
    code = """if True:
        import os, sys, torch
        import kernels.paged_attention as pa
        assert "triton" not in sys.modules
        q, pool = torch.randn(3, 4, 16), torch.randn(2, 32, 16)
        args = (q, pool, pool, torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32),
                torch.tensor([0, 3], dtype=torch.int32), 16, 0.25)
        out = pa.paged_attention(*args, backend="triton")
        assert os.environ["TRITON_INTERPRET"] == "1"
        torch.testing.assert_close(out, pa.paged_attention_reference(*args))
    """
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SPECDEC_KERNELS")}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
