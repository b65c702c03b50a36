"""Batch invariance, bit for bit: kernels/batch_invariant.py (matmul, rms_norm) and kernels/paged_attention.py.

A row's (a query's) result must not depend on the pass around it: M rows or 1, its offset in the batch, its
neighbours, other sequences' context lengths. Checked with ``torch.equal``, never allclose. The kernels run
compiled on CUDA and in Triton's interpreter on a CPU (tests/kernels/conftest.py): there the check is necessary,
not sufficient; the kernels are built so it holds on a GPU too (one tile config, no split-K, no atomics).
Closeness to the torch references (tails, bias, dtypes) and the shape errors are checked as well.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels.batch_invariant as bi
from kernels.batch_invariant import matmul, matmul_reference, matmul_triton, rms_norm, rms_norm_reference, \
    rms_norm_triton
from kernels.paged_attention import paged_attention_triton
from tests.kernels.conftest import DEVICE

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MS = (1, 2, 5, 8, 13, 37, 70)  # 70: two row tiles (BLOCK_M = 64)
N, K = 200, 150                # neither a multiple of BLOCK_N or BLOCK_K: tails in every tile row and K walk
POOL = 40                      # distinct rows; batches draw from them (with repeats past 40)


def _rows(n, width, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g).to(dtype).to(DEVICE)


def _batches(seed):
    """For each M: (batch M, row indices into the pool) with random rows and neighbours, plus fixed rows put at
    chosen offsets (first, middle, last; either side of the row-tile boundary)."""
    g = torch.Generator().manual_seed(seed)
    for m in MS:
        for _ in range(2):
            yield m, torch.randint(0, POOL, (m,), generator=g)
    for m, offsets in ((13, (0, 6, 12)), (37, (36,)), (70, (63, 64, 69))):
        for offset in offsets:
            idx = torch.randint(0, POOL, (m,), generator=g)
            idx[offset] = 3
            yield m, idx


@pytest.mark.heavy
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_matmul_rows_are_batch_invariant(dtype):
    pool = _rows(POOL, K, dtype, seed=1)
    weight, bias = _rows(N, K, dtype, seed=2), _rows(1, N, dtype, seed=3)[0]
    alone = [matmul_triton(pool[i: i + 1], weight, bias)[0] for i in range(POOL)]  # M = 1, a view at offset i
    assert torch.equal(matmul_triton(pool[3: 4].clone(), weight, bias)[0], alone[3])  # a fresh tensor
    for m, idx in _batches(seed=4):
        out = matmul_triton(pool[idx], weight, bias)
        assert out.shape == (m, N) and out.dtype == dtype
        for row, i in enumerate(idx.tolist()):
            assert torch.equal(out[row], alone[i]), f"M={m}: row {row} (pool row {i}) differs from M=1"
    # the same rows inside a bigger buffer: a strided view, x's rows not contiguous with each other
    wide = torch.zeros(POOL, 2 * K, dtype=dtype, device=DEVICE)
    wide[:, 5: 5 + K] = pool
    out = matmul_triton(wide[:, 5: 5 + K], weight, bias)
    assert all(torch.equal(out[i], alone[i]) for i in range(POOL))


@pytest.mark.heavy
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rms_norm_rows_are_batch_invariant(dtype):
    width = bi.RMS_BLOCK + 476  # two blocks, the second a tail
    pool = _rows(POOL, width, dtype, seed=5)
    alone = [rms_norm_triton(pool[i: i + 1], 1e-6)[0] for i in range(POOL)]
    for m, idx in _batches(seed=6):
        out = rms_norm_triton(pool[idx], 1e-6)
        assert out.shape == (m, width) and out.dtype == torch.float32
        for row, i in enumerate(idx.tolist()):
            assert torch.equal(out[row], alone[i]), f"M={m}: row {row} (pool row {i}) differs from M=1"
    wide = torch.zeros(POOL, width + 9, dtype=dtype, device=DEVICE)
    wide[:, 3: 3 + width] = pool
    out = rms_norm_triton(wide[:, 3: 3 + width], 1e-6)  # a strided view
    assert all(torch.equal(out[i], alone[i]) for i in range(POOL))


def test_matmul_launches_one_config_for_every_m(monkeypatch):
    """Only the grid follows M: every constexpr (tiles, warps, stages) is the same for a decode and a prefill,
    and M is not specialised on, so both run one binary."""
    kernel = bi._kernels()[0]
    dns = getattr(kernel, "do_not_specialize", None) or getattr(kernel, "kwargs", {}).get("do_not_specialize")
    assert list(dns) in (["M"], [4]), dns
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append((grid, meta))

    monkeypatch.setattr(bi, "_kernels", lambda: (Recorder(), Recorder()))
    weight = _rows(N, K, torch.bfloat16, seed=7)
    for m in (1, 37, 500):
        matmul_triton(_rows(m, K, torch.bfloat16, seed=m), weight)
    metas = [meta for _, meta in launches]
    assert metas[0] == metas[1] == metas[2]
    assert [grid for grid, _ in launches] == [(4,), (4,), (8 * 4,)]
    assert {k: metas[0][k] for k in bi.MATMUL_CONFIGS[torch.bfloat16]} == bi.MATMUL_CONFIGS[torch.bfloat16]


def test_misaligned_views_are_copied_before_launch():
    """Triton specialises on 16-byte pointer alignment, and on sm_90 an aligned bf16 row loads 8 per thread where
    a misaligned one loads 4 (tests/kernels/aot.py's compile of rms_norm shows both layouts): a different
    reduction tree. So a view starting mid-line (a row sliced off a batch) reaches the kernels as a copy."""
    base = torch.randn(10, 7, device=DEVICE)  # 28-byte rows
    assert base[1:].data_ptr() % 16 and bi._aligned(base[1:]).data_ptr() % 16 == 0
    assert torch.equal(bi._aligned(base[1:]), base[1:])
    assert bi._aligned(base) is base and bi._aligned(base[4:]).data_ptr() == base[4:].data_ptr()


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU compiles them for real (tests/kernels/test_cuda.py)")
def test_kernels_compile_for_sm90_without_a_gpu():
    """matmul, rms_norm and paged attention (one program per query, or per split plus the merge) compile ahead of time for an H100/H200 (tests/kernels/aot.py, without
    the interpreter): bf16 on wgmma, fp32 without TF32, no atomics (nothing is summed across programs), the RMS
    norm's divisions and square root correctly rounded."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.aot", "kernels.batch_invariant",
                           "kernels.paged_attention"], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report) == {"_matmul_kernel[bf16]", "_matmul_kernel[fp32]", "_rms_norm_kernel[bf16]",
                           "_paged_attention_kernel[bf16]", "_paged_attention_kernel[bf16][splits]",
                           "_merge_kernel[bf16]"}, report
    assert all(r["cubin"] and not r["atomics"] for r in report.values()), report
    assert report["_matmul_kernel[bf16]"]["wgmma"], report
    assert not report["_matmul_kernel[fp32]"]["tf32"] and not report["_matmul_kernel[fp32]"]["wgmma"], report
    rms = report["_rms_norm_kernel[bf16]"]
    assert rms["div_rn"] and rms["sqrt_rn"] and not rms["div_full"], report


# ------------------------------------------------------------------------------------------------- references

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("m, n, k, with_bias", [(37, 200, 150, True), (1, 7, 3, False), (70, 64, 128, True),
                                                (5, 130, 0, True), (0, 9, 4, False)])
def test_matmul_matches_reference(dtype, m, n, k, with_bias):
    x, weight = _rows(m, k, dtype, seed=m + k), _rows(n, k, dtype, seed=n)
    bias = _rows(1, n, dtype, seed=11)[0] if with_bias else None
    got, ref = matmul_triton(x, weight, bias), matmul_reference(x, weight, bias)
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got, ref, **TOL[dtype])
    plain = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(ref.float(), plain, **TOL[dtype])  # the reference is the plain formula


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("width", [5, 64, 2 * bi.RMS_BLOCK + 452])
def test_rms_norm_matches_reference(dtype, width):
    x = _rows(6, width, dtype, seed=width) * 3
    x[2] = 0  # eps keeps a zero row finite: zeros out
    got, ref = rms_norm_triton(x, 1e-5), rms_norm_reference(x, 1e-5)
    assert got.dtype == torch.float32 and not got.isnan().any() and not got[2].any()
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    xf = x.float()
    torch.testing.assert_close(ref, xf / (xf.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt(), atol=1e-6, rtol=1e-5)


def test_dispatch(monkeypatch):
    monkeypatch.delenv("SPECDEC_KERNELS", raising=False)
    x, weight = _rows(3, 20, torch.float32, seed=0), _rows(9, 20, torch.float32, seed=1)
    assert torch.equal(matmul(x, weight, backend="triton"), matmul_triton(x, weight))
    assert torch.equal(matmul(x, weight, backend="torch"), matmul_reference(x, weight))
    assert torch.equal(rms_norm(x, 1e-6, backend="triton"), rms_norm_triton(x, 1e-6))
    assert torch.equal(rms_norm(x, 1e-6, backend="torch"), rms_norm_reference(x, 1e-6))
    chosen = []
    for name in ("matmul_triton", "matmul_reference", "rms_norm_triton", "rms_norm_reference"):
        monkeypatch.setattr(bi, name, lambda *a, name=name: chosen.append(name.split("_")[-1]))
    bi.matmul(x, weight)
    bi.rms_norm(x, 1e-6)
    assert chosen == (["triton", "triton"] if DEVICE == "cuda" else ["reference", "reference"])


def test_rejects_bad_shapes():
    x, weight = torch.randn(3, 8), torch.randn(5, 8)
    cases = [((x[0], weight), "x \\[M, K\\]"), ((x, weight.T), "disagree on K"),
             ((x, weight, torch.randn(4)), "bias must be \\[5\\]"),
             ((x, weight.half()), "share one of"), ((x.long(), weight.long()), "share one of")]
    for fn in (matmul_triton, matmul_reference, matmul):
        for args, message in cases:
            with pytest.raises(ValueError, match=message):
                fn(*args)
    for fn in (rms_norm_triton, rms_norm_reference):
        with pytest.raises(ValueError, match="x \\[M, N\\]"):
            fn(x[None], 1e-6)
        with pytest.raises(ValueError, match="eps"):
            fn(x, -1.0)
        with pytest.raises(ValueError, match="supports"):
            fn(x.long(), 1e-6)


# ------------------------------------------------------------------------------------------------- paged attention

BLOCK, HEADS, KV_HEADS, DIM = 8, 2, 1, 16  # GQA: two heads read one kv head
LENGTHS = (45, 23, 61)  # three sequences' full lengths


def _universe(dtype, seed=0):
    """Each sequence's keys and values [kv_heads, L, dim] and its query at every position [L, heads, dim]."""
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(*shape, generator=g).to(dtype) for shape in
                  ((KV_HEADS, n, DIM), (KV_HEADS, n, DIM), (n, HEADS, DIM))) for n in LENGTHS]


def _attend(universe, spans, window, seed):
    """One pass: spans are (sequence, first new position, new tokens). The pool (NaN wherever no sequence lives)
    and the scattered block tables are drawn afresh per pass. Returns {(sequence, position): [heads, dim]}."""
    g = torch.Generator().manual_seed(seed)
    dtype = universe[0][0].dtype
    need = [math.ceil((first + n) / BLOCK) for _, first, n in spans]
    num_blocks = sum(need) + 3
    physical = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (len(spans), max(need) + 2), generator=g, dtype=torch.int32)
    k_pool = torch.full((KV_HEADS, num_blocks * BLOCK, DIM), float("nan"), dtype=dtype)
    v_pool = k_pool.clone()
    used, queries, where = 0, [], []
    for i, (s, first, n) in enumerate(spans):
        tables[i, : need[i]] = physical[used: used + need[i]].to(torch.int32)
        used += need[i]
        pos = torch.arange(first + n)
        rows = tables[i, pos // BLOCK].long() * BLOCK + pos % BLOCK
        k_pool[:, rows], v_pool[:, rows] = universe[s][0][:, : first + n], universe[s][1][:, : first + n]
        queries.append(universe[s][2][first: first + n])
        where += [(s, first + j) for j in range(n)]
    qsl = torch.tensor([0] + [n for *_, n in spans]).cumsum(0).to(torch.int32)
    ctx = torch.tensor([first + n for _, first, n in spans], dtype=torch.int32)
    out = paged_attention_triton(torch.cat(queries).to(DEVICE), k_pool.to(DEVICE), v_pool.to(DEVICE),
                                 tables.to(DEVICE), ctx.to(DEVICE), qsl.to(DEVICE), BLOCK, DIM ** -0.5, window)
    assert not out.isnan().any()
    return dict(zip(where, out.cpu()))


PASSES = [  # the same queries as windows of n = 2 and 5, prefills, and beside other sequences' windows
    [(0, 40, 5)], [(0, 7, 2)], [(0, 15, 2)], [(0, 0, 5)], [(1, 18, 5)], [(2, 58, 2)],
    [(1, 20, 2), (0, 41, 2), (2, 60, 1)],
    [(2, 56, 5), (0, 40, 5)],
    [(0, 44, 1), (1, 0, 9), (2, 15, 2)],
    [(2, 59, 2), (1, 16, 5), (0, 6, 5)],
]


@pytest.mark.heavy
@pytest.mark.parametrize("window", [None, 8], ids=["full", "window8"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_paged_attention_queries_are_batch_invariant(dtype, window):
    universe = _universe(dtype)
    alone: dict = {}  # each query as a decode: its sequence's only new token, the only sequence in the pass
    for p, spans in enumerate(PASSES):
        got = _attend(universe, spans, window, seed=100 + p)
        for (s, pos), value in got.items():
            if (s, pos) not in alone:
                alone.update(_attend(universe, [(s, pos, 1)], window, seed=pos))
            assert torch.equal(value, alone[(s, pos)]), f"pass {spans}: sequence {s} position {pos} differs"


@pytest.mark.parametrize("window", [None, 8], ids=["full", "window8"])
def test_split_keys_keep_queries_batch_invariant_whichever_mode_a_pass_takes(window, monkeypatch):
    """Keys reduced in splits of 16 (several per query here): the passes of at most 5 tokens run one program
    per split and a merge (flash-decoding), the bigger ones one program per query; a query's output is the same
    bits in both, and as a decode alone."""
    import kernels.paged_attention as pa

    monkeypatch.setattr(pa, "SPLIT_KEYS", 16)
    monkeypatch.setattr(pa, "PARALLEL_SPLITS_MAX_TOKENS", 5)
    universe = _universe(torch.float32)
    alone: dict = {}
    for p, spans in enumerate(PASSES[:4] + PASSES[6:8]):
        for (s, pos), value in _attend(universe, spans, window, seed=100 + p).items():
            if (s, pos) not in alone:
                alone.update(_attend(universe, [(s, pos, 1)], window, seed=pos))
            assert torch.equal(value, alone[(s, pos)]), f"pass {spans}: sequence {s} position {pos} differs"


# ------------------------------------------------------------------------------------------------- the benchmark


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the message a machine without CUDA gets")
def test_cuda_benchmark_says_it_needs_cuda():
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "benchmarks/bench_batch_invariant_cuda.py"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "needs a CUDA device" in done.stderr, done.stderr[-2000:]
