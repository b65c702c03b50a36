"""specdec/engine/attention.py: a ragged pass reads each sequence's blocks in place and equals plain attention
over a contiguous copy of its history; the Triton kernel path (the interpreter here) equals the CPU path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.dispatch import use_interpreter
from specdec.engine.attention import PagedPass, block_runs
from specdec.engine.kv_cache import KVPool

if not torch.cuda.is_available():
    use_interpreter()  # before any kernel is defined (as tests/kernels/conftest.py does)

HEADS, KV_HEADS, DIM, BS = 4, 2, 8, 4
FULL = "full_attention"


@pytest.fixture()
def pool():
    torch.manual_seed(0)
    p = KVPool(1, KV_HEADS, DIM, torch.float32, torch.device("cpu"), budget_bytes=2 * KV_HEADS * DIM * 4 * BS * 32,
               block_size=BS)
    p.key_data.normal_()
    p.value_data.normal_()
    return p


def _reference(pool, q, tables, starts, counts, window, scale):
    outs, q0 = [], 0
    for table, start, n in zip(tables, starts, counts):
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(start + n)])
        keys, values = pool.keys[0][:, slots][None], pool.values[0][:, slots][None]
        qp, kp = torch.arange(start, start + n)[:, None], torch.arange(start + n)[None]
        allowed = kp <= qp
        if window:
            allowed &= kp > qp - window
        o = F.scaled_dot_product_attention(q[:, :, q0:q0 + n], keys, values, attn_mask=allowed, scale=scale,
                                           enable_gqa=True)
        outs.append(o[0].transpose(0, 1).reshape(n, HEADS * DIM))
        q0 += n
    return torch.cat(outs)


CASES = [  # block tables (scattered, some consecutive), cached lengths, new tokens
    ([[0, 1, 2]], [5], [3]),  # one slice, a causal tail
    ([[0, 5, 6]], [5], [3]),  # two slices, merged by log-sum-exp
    ([[0, 5, 6], [9, 10, 11, 20]], [5, 1], [3, 12]),  # a prefill chunk whose early queries see nothing of slice 2
    ([[0, 5, 6], [9, 10, 11, 20], [30]], [8, 12, 0], [1, 1, 3]),  # decode steps beside a first pass
    ([[3, 7, 2, 4]], [0], [16]),  # every block its own slice
]


@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("tables,starts,counts", CASES)
def test_paged_pass_equals_attention_over_a_contiguous_copy(pool, tables, starts, counts, window):
    t = sum(counts)
    q, k, v = torch.randn(1, HEADS, t, DIM), torch.randn(1, KV_HEADS, t, DIM), torch.randn(1, KV_HEADS, t, DIM)
    paged = PagedPass(pool, tables, starts, counts, {FULL: window}, group=HEADS // KV_HEADS)
    out = paged.attend(0, FULL, q, k, v, 0.3)
    assert out.shape == (1, t, HEADS * DIM)
    # the new keys/values went to their slots
    assert torch.equal(pool.keys[0][:, paged.slots], k[0]) and torch.equal(pool.values[0][:, paged.slots], v[0])
    torch.testing.assert_close(out[0], _reference(pool, q, tables, starts, counts, window, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_the_triton_kernel_path_equals_the_cpu_path(pool, window):
    """The CUDA side of the same pass (kernels.paged_attention), run by Triton's interpreter."""
    tables, starts, counts = CASES[3]
    t = sum(counts)
    q, k, v = torch.randn(1, HEADS, t, DIM), torch.randn(1, KV_HEADS, t, DIM), torch.randn(1, KV_HEADS, t, DIM)
    cpu = PagedPass(pool, tables, starts, counts, {FULL: window}, group=HEADS // KV_HEADS).attend(0, FULL, q, k, v, 0.3)
    kernel = PagedPass(pool, tables, starts, counts, {FULL: window}, kernel="triton", group=HEADS // KV_HEADS).attend(0, FULL, q, k, v, 0.3)
    torch.testing.assert_close(kernel, cpu, rtol=1e-4, atol=1e-4)


def test_block_runs_merge_consecutive_blocks_and_stop_at_the_length():
    assert block_runs([4, 5, 6, 9], 14, 4) == [(16, 0, 12), (36, 12, 2)]
    assert block_runs([4, 5, 6, 9], 3, 4) == [(16, 0, 3)]
    assert block_runs([2, 1], 8, 4) == [(8, 0, 4), (4, 4, 4)]
    assert block_runs([], 0, 4) == []
