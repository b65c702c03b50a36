"""kernels/rejection.py against its torch reference (specdec/rejection.py), decision for decision.

Under TRITON_INTERPRET=1 on a CPU (tests/kernels/conftest.py), for real on CUDA. Both paths read the random
numbers ``RaggedBatch.build`` drew, so greedy and sampled rows must give identical (accepted, next token)
pairs; the one-row ``rejection_sample`` must agree too when given generators in the same state.
"""

from __future__ import annotations

import pytest
import torch

from kernels.rejection import accept_batch as triton_accept
from specdec.rejection import (RaggedBatch, accept_batch, accept_rows, coupled_accept, greedy_accept, race_scores,
                               rejection_sample)
from specdec.seeding import race_noise
from tests.kernels.conftest import DEVICE


def _ragged(vocab: int, ks: list[int], kinds: list[str], seed: int):
    """Rows of draft k_i; kind per row: "greedy" (greedy request), "q" (draft sent q), "one-hot" (no q).

    Targets are peaky; q is a blend of p and noise, and drafts are drawn from q (or p's argmax for one-hot
    rows half the time), so acceptances, rejections and full acceptances all happen."""
    g = torch.Generator().manual_seed(seed)
    drafts, targets, qs, greedy = [], [], [], []
    for k, kind in zip(ks, kinds):
        logits = torch.randn(k + 1, vocab, generator=g) * 4
        if kind == "greedy" and vocab > 3:  # ties at the maximum: the lowest id must win in both paths
            logits[:, vocab - 1] = logits.max(-1).values
        p = torch.softmax(logits, -1)
        mix = torch.softmax(torch.randn(k, vocab, generator=g) * 4, -1)
        q = (0.7 * p[:k] + 0.3 * mix) if k else torch.empty(0, vocab)
        if kind == "greedy":
            d = torch.where(torch.rand(k, generator=g) < 0.8, logits[:k].argmax(-1),
                            torch.randint(0, vocab, (k,), generator=g))
            targets.append(logits)  # greedy rows go in as logits
        else:
            d = torch.multinomial(q, 1, generator=g)[:, 0] if k else torch.empty(0, dtype=torch.long)
            if kind == "one-hot":
                d = torch.where(torch.rand(k, generator=g) < 0.5, p[:k].argmax(-1), d)
            targets.append(p)
        drafts.append(d.tolist())
        qs.append(q if kind == "q" else None)
        greedy.append(kind == "greedy")
    return drafts, targets, qs, greedy


def _batch(vocab, ks, kinds, seed, gen_seed):
    drafts, targets, qs, greedy = _ragged(vocab, ks, kinds, seed)
    gens = [torch.Generator(device=DEVICE).manual_seed(gen_seed + i) for i in range(len(ks))]
    dev = [t.to(DEVICE) for t in targets]
    return RaggedBatch.build(drafts, dev, [q.to(DEVICE) if q is not None else None for q in qs], greedy, gens, DEVICE), \
        (drafts, dev, qs, greedy)


KS = list(range(9))  # k = 0..8 in one batch


@pytest.mark.parametrize("vocab", [100, 1000, 49152])
def test_greedy_rows_bit_exact(vocab):
    batch, (drafts, targets, _, _) = _batch(vocab, KS, ["greedy"] * len(KS), seed=vocab, gen_seed=0)
    ref = accept_batch(batch)
    got = triton_accept(batch)
    assert got.tolist() == ref.tolist() == accept_rows(batch).tolist()
    rows = [greedy_accept(torch.tensor(d, dtype=torch.long, device=DEVICE), t.argmax(-1)) for d, t in zip(drafts, targets)]
    assert [tuple(x) for x in ref.T.tolist()] == rows
    n = ref[0].tolist()
    assert 0 < sum(n) and any(a == k for a, k in zip(n, KS) if k) and any(a < k for a, k in zip(n, KS))


MIXED = ["q", "greedy", "one-hot", "q", "one-hot", "greedy", "q", "q", "one-hot"]


@pytest.mark.parametrize("vocab, seeds", [(100, range(6)), (1000, range(3)), (49152, range(1))])
def test_ragged_mixed_rows_identical_decisions(vocab, seeds):
    """k = 0..8, greedy / sampled-with-q / sampled-one-hot rows in one batch: the same decisions, and the
    same as one-row ``rejection_sample`` / ``greedy_accept`` with generators in the same state."""
    outcomes = set()
    for seed in seeds:
        batch, (drafts, targets, qs, greedy) = _batch(vocab, KS, MIXED, seed=seed, gen_seed=100 * seed)
        ref = accept_batch(batch)
        got = triton_accept(batch)
        assert got.tolist() == ref.tolist(), f"seed {seed}"
        assert accept_rows(batch).tolist() == ref.tolist(), f"seed {seed}"  # the CPU's torch path
        for i, (d, t, q, gr) in enumerate(zip(drafts, targets, qs, greedy)):
            d = torch.tensor(d, dtype=torch.long, device=DEVICE)
            if gr:
                row = greedy_accept(d, t.argmax(-1))
            else:
                g = torch.Generator(device=DEVICE).manual_seed(100 * seed + i)
                row = rejection_sample(d, q.to(DEVICE) if q is not None else None, t, g)
            assert row == tuple(ref[:, i].tolist()), f"seed {seed} row {i}"
            outcomes.add(("greedy" if gr else "sampled", "all" if row[0] == KS[i] else "rejected"))
    if vocab == 100:  # every path of the rule ran
        assert outcomes >= {("greedy", "all"), ("greedy", "rejected"), ("sampled", "all"), ("sampled", "rejected")}


def test_vocabulary_of_262144():
    """Gemma-3's vocabulary: tiled, one sampled row (q) and one greedy row, plus a one-hot row."""
    batch, _ = _batch(262_144, [3, 2, 1], ["q", "greedy", "one-hot"], seed=7, gen_seed=7)
    assert triton_accept(batch).tolist() == accept_batch(batch).tolist() == accept_rows(batch).tolist()


def test_identical_p_and_q_accepts_all_and_bonus_agrees():
    vocab = 300
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(5, vocab, generator=g) * 3, -1)
    drafts = [torch.multinomial(p[:4], 1, generator=g)[:, 0].tolist()]
    gens = [torch.Generator(device=DEVICE).manual_seed(1)]
    batch = RaggedBatch.build(drafts, [p.to(DEVICE)], [p[:4].to(DEVICE)], [False], gens, DEVICE)
    ref = accept_batch(batch)
    assert ref[0].tolist() == [4]
    assert triton_accept(batch).tolist() == ref.tolist()


def test_rejected_one_hot_draft_is_never_recovered():
    """q one-hot at the draft, p gives it no mass: always rejected, and the recovered token is never it."""
    vocab = 64
    p = torch.softmax(torch.randn(2, vocab), -1)
    p[0, 5] = 0.0
    for s in range(5):
        batch = RaggedBatch.build([[5]], [p.to(DEVICE)], [None], [False], [torch.Generator(device=DEVICE).manual_seed(s)],
                                  DEVICE)
        n, tok = triton_accept(batch)[:, 0].tolist()
        assert n == 0 and tok != 5
        assert (n, tok) == tuple(accept_batch(batch)[:, 0].tolist())


def test_kernels_compile_for_sm90_without_a_gpu():
    """Every kernel compiles ahead of time to a cubin for an H100/H200 (sm_90), as a GPU machine would compile it
    (tests/kernels/aot.py, in a process without the interpreter); division is correctly rounded, as torch's."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.aot"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["_accept_kernel"]["cubin"] and report["_argmax_kernel"]["cubin"], report
    assert all(r["cubin"] for r in report.values()), report
    assert report["_accept_kernel"]["div_rn"] and not report["_accept_kernel"]["div_full"], report


@pytest.mark.parametrize("vocab", [100, 49152])
def test_coupled_rows_as_greedy_rows_of_p_over_e(vocab):
    """The target worker hands a coupled row (seeded, sampled) to the kernels as a greedy row whose target
    rows are p / E: the kernel decides it as the coupled reference does, beside sampled rows."""
    g = torch.Generator().manual_seed(vocab)
    kinds = ["coupled", "q", "coupled", "one-hot", "coupled"]
    ks = [3, 2, 0, 4, 5]
    drafts, targets, qs, expected = [], [], [], {}
    for i, (k, kind) in enumerate(zip(ks, kinds)):
        p = torch.softmax(4 * torch.randn(k + 1, vocab, generator=g), -1)
        d = torch.randint(0, vocab, (k,), generator=g)
        q = None
        if kind == "coupled":
            noise = race_noise(i, range(30, 30 + k + 1), vocab)
            d[: i % 3] = (p / noise).argmax(-1)[: min(i % 3, k)]  # 0, 1 or 2 right drafts, then (mostly) wrong
            expected[i] = coupled_accept(d, p, noise)
            p = race_scores(p, noise)
        elif kind == "q":
            q = torch.softmax(torch.randn(k, vocab, generator=g), -1)
            d = torch.multinomial(q, 1, generator=g)[:, 0]
        drafts.append(d.tolist())
        targets.append(p.to(DEVICE))
        qs.append(q.to(DEVICE) if q is not None else None)
    gens = [torch.Generator(device=DEVICE).manual_seed(i) for i in range(len(ks))]
    batch = RaggedBatch.build(drafts, targets, qs, [k == "coupled" for k in kinds], gens, DEVICE)
    got = triton_accept(batch)
    assert got.tolist() == accept_batch(batch).tolist() == accept_rows(batch).tolist()
    for i, row in expected.items():
        assert tuple(got[:, i].tolist()) == row, i
