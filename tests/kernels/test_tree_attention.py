"""Token trees in paged attention (kernels.paged_attention.TreePaths): each node attends to the history and its
ancestors only. Checked against a brute-force recompute per path (each node's path laid out as a chain in its
own block table), in the torch reference, the Triton kernel (interpreted here) and the batch-invariant C kernel,
where a node's output must be the chain's bits."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_attention
from kernels.cpu_attention import CHUNK, paged_attention_cpu
from kernels.paged_attention import TreePaths, paged_attention_reference, paged_attention_triton

BS = 16
TREE = [-1, 0, 0, 1, 1, 2, -1, 6, 3, 8]  # two root children, branches of depth up to 4


def _case(history: int, parents: list[int], heads=4, kv_heads=2, dim=64, dtype=torch.float32, seed=0):
    """One sequence: ``history`` cached tokens and a tree's nodes after them, in scattered blocks of a pool whose
    other rows are NaN (a read of a row the sequence does not own shows)."""
    g = torch.Generator().manual_seed(seed)
    t = len(parents)
    blocks = -(-(history + t) // BS)
    num_blocks = 3 * blocks + 4
    table = torch.randperm(num_blocks, generator=g)[:blocks].tolist()
    k = torch.full((kv_heads, num_blocks * BS, dim), float("nan"), dtype=dtype)
    v = torch.full_like(k, float("nan"))
    for p in range(history + t):
        slot = table[p // BS] * BS + p % BS
        k[:, slot] = torch.randn(kv_heads, dim, generator=g).to(dtype)
        v[:, slot] = torch.randn(kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(1 + t, heads, dim, generator=g).to(dtype)  # the root (the last history token), then the nodes
    return q, k, v, table


def _tree_call(fn, q, k, v, table, history, parents, window=None, **extra):
    t = len(parents)
    tree = TreePaths.of([table], [history - 1], [1 + t], [parents], BS)
    args = (q, k, v, torch.tensor([table], dtype=torch.int32), torch.tensor([history + t], dtype=torch.int32),
            torch.tensor([0, 1 + t], dtype=torch.int32), BS, 0.125)
    return fn(*args, window=window, tree=tree, **extra)


def _as_chains(fn, q, k, v, table, history, parents, window=None):
    """Each node on its own: its path copied after the history into a fresh sequence, queried as a chain's last
    token (the root: the last history token)."""
    from specdec.trees import path_to

    out = [fn(q[:1], k, v, torch.tensor([table], dtype=torch.int32), torch.tensor([history], dtype=torch.int32),
              torch.tensor([0, 1], dtype=torch.int32), BS, 0.125, window=window)[0]]
    for i in range(len(parents)):
        path = path_to(parents, i)
        kc, vc = k.clone(), v.clone()
        n = history + len(path)
        chain = list(table[: -(-history // BS)])
        spare = [b for b in range(k.shape[1] // BS) if b not in table]
        while len(chain) * BS < n:
            chain.append(spare.pop())
        for j, node in enumerate(path):  # node's row -> chain position history + j
            src = table[(history + node) // BS] * BS + (history + node) % BS
            p = history + j
            dst = chain[p // BS] * BS + p % BS
            kc[:, dst], vc[:, dst] = k[:, src], v[:, src]
        out.append(fn(q[1 + i: 2 + i], kc, vc, torch.tensor([chain], dtype=torch.int32),
                      torch.tensor([n], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), BS, 0.125,
                      window=window)[0])
    return torch.stack(out)


@pytest.mark.parametrize("history, window", [(5, None), (40, None), (40, 3), (CHUNK + 7, None), (CHUNK - 2, None)])
def test_reference_is_the_brute_force_per_path(history, window):
    q, k, v, table = _case(history, TREE)
    got = _tree_call(paged_attention_reference, q, k, v, table, history, TREE, window)
    want = _as_chains(paged_attention_reference, q, k, v, table, history, TREE, window)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_chain_tree_is_the_chain():
    history, chain = 20, [-1, 0, 1, 2]
    q, k, v, table = _case(history, chain)
    got = _tree_call(paged_attention_reference, q, k, v, table, history, chain)
    args = (q, k, v, torch.tensor([table], dtype=torch.int32), torch.tensor([history + 4], dtype=torch.int32),
            torch.tensor([0, 5], dtype=torch.int32), BS, 0.125)
    torch.testing.assert_close(got, paged_attention_reference(*args), atol=1e-6, rtol=1e-5)


def test_a_node_that_saw_a_sibling_would_differ():
    """Negative control: a wrong mask (node 2 reading node 1, its sibling, as a chain would) is caught."""
    history = 12
    q, k, v, table = _case(history, TREE)
    got = _tree_call(paged_attention_reference, q, k, v, table, history, TREE)
    as_chain = paged_attention_reference(q, k, v, torch.tensor([table], dtype=torch.int32),
                                         torch.tensor([history + len(TREE)], dtype=torch.int32),
                                         torch.tensor([0, 1 + len(TREE)], dtype=torch.int32), BS, 0.125)
    assert torch.allclose(got[:3], as_chain[:3], atol=1e-6)  # the root and nodes 0, 1 see the same keys
    assert not torch.allclose(got[3], as_chain[3], atol=1e-3)  # node 2 (a sibling of 1) must not see node 1


@pytest.mark.parametrize("window", [None, 4])
def test_triton_matches_the_reference(window):
    history = 37
    q, k, v, table = _case(history, TREE)
    want = _tree_call(paged_attention_reference, q, k, v, table, history, TREE, window)
    for parallel in (False, True):
        got = _tree_call(lambda *a, **kw: paged_attention_triton(*a, parallel=parallel, **kw), q, k, v, table,
                         history, TREE, window)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


ok, why = cpu_attention.available()


@pytest.mark.skipif(not ok, reason=f"the CPU kernel cannot be built here: {why}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("history, window", [(9, None), (CHUNK - 3, None), (CHUNK + 40, None), (60, 5)])
def test_cpu_kernel_gives_each_node_the_chains_bits(dtype, history, window):
    q, k, v, table = _case(history, TREE, dtype=dtype)
    chains = _as_chains(paged_attention_cpu, q, k, v, table, history, TREE, window)
    for threads in (1, 2, 4):  # (one sequence: its nodes are split among the threads where the work is enough)
        got = _tree_call(paged_attention_cpu, q, k, v, table, history, TREE, window, threads=threads)
        assert torch.equal(got, chains), f"{threads} threads"
    want = _tree_call(paged_attention_reference, q, k, v, table, history, TREE, window)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.float(), want.float(), **tol)
