"""The acceptance rules of specdec/rejection.py.

Distribution tests: the target distributions p_0..p_k are fixed (they do not depend on the prefix,
a special case of the real algorithm), the draft samples x_i ~ q_i, and the rejection sampler must
emit tokens distributed exactly as p: the first emitted token ~ p_0, and the token at position j,
given that the first j drafts were accepted, ~ p_j. A Pearson chi-square test with a fixed seed
checks that; the same check must reject deliberately broken samplers (negative controls), which
shows it has the power to catch a lossy sampler.
"""

from __future__ import annotations

import pytest
import torch

from specdec.rejection import greedy_accept, rejection_sample
from tests.broken_samplers import accept_always, recover_from_p

VOCAB = 8
NUM_DRAWS = 16_000
ALPHA = 1e-3  # a correct sampler passes at this level (fixed seeds: the test is deterministic)
REJECT = 1e-8  # a broken sampler must be rejected far beyond doubt


def _dist(values) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum()


# Per position: target p_i and draft q_i, deliberately different. p gives token 7 no mass (as a
# top-k/top-p filtered target would) while q likes it; q gives token 0 no mass while p likes it
# (only the residual can produce it).
P_ROWS = [
    _dist([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.07, 0.00]),
    _dist([0.05, 0.05, 0.40, 0.20, 0.10, 0.10, 0.10, 0.00]),
    _dist([0.20, 0.10, 0.10, 0.10, 0.10, 0.10, 0.30, 0.00]),
    _dist([0.125] * 8),
]
Q_ROWS = [
    _dist([0.00, 0.40, 0.05, 0.05, 0.20, 0.05, 0.05, 0.20]),
    _dist([0.10, 0.10, 0.10, 0.10, 0.30, 0.10, 0.10, 0.10]),
    _dist([0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.50, 0.20]),
]


def _run(sampler, k: int, num_draws: int, seed: int, one_hot_draft: int | None = None):
    """Draw ``num_draws`` rounds; return per-position emitted-token counts and how many rounds reached it.

    one_hot_draft: a greedy draft that always proposes this token (draft_probs=None).
    """
    target_probs = torch.stack(P_ROWS[:k] + [P_ROWS[3]])  # [k + 1, vocab]
    if one_hot_draft is None:
        draft_probs = torch.stack(Q_ROWS[:k])  # [k, vocab]
        g_draft = torch.Generator().manual_seed(seed + 1)
        drafts = torch.multinomial(draft_probs, num_draws, replacement=True, generator=g_draft).T  # [draws, k]
    else:
        draft_probs = None
        drafts = torch.full((num_draws, k), one_hot_draft, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    counts = [[0] * VOCAB for _ in range(k + 1)]
    num_accepted = [0] * (k + 1)
    for draft, draft_list in zip(drafts.unbind(0), drafts.tolist()):
        n, next_token = sampler(draft, draft_probs, target_probs, g)
        assert 0 <= n <= k
        for pos, tok in enumerate(draft_list[:n] + [next_token]):
            counts[pos][tok] += 1
        num_accepted[n] += 1
    return torch.tensor(counts), torch.tensor(num_accepted), target_probs


def _positions_pvalues(chi2_pvalue, counts, target_probs, min_rounds=2000):
    """p-value per emitted position that enough rounds reached."""
    out = {}
    for pos in range(counts.shape[0]):
        if counts[pos].sum() >= min_rounds:
            out[pos] = chi2_pvalue(counts[pos], target_probs[pos])
    return out


# --------------------------------------------------------------------------------------------------
# broken samplers for the negative controls


def _return_draft_token(draft, draft_probs, target_probs, generator):
    """Emits the first draft token unconditionally as the 'recovered' token."""
    return 0, int(draft[0])


def _accept_if_p_positive(draft, draft_probs, target_probs, generator):
    """Forgets the p/q ratio: accepts any draft the target could have produced."""
    k = draft.shape[0]
    for i in range(k):
        if target_probs[i, draft[i]] <= 0:
            residual = target_probs[i].clone()
            residual[draft[i]] = 0
            return i, int(torch.multinomial(residual, 1, generator=generator))
    return k, int(torch.multinomial(target_probs[k], 1, generator=generator))


# --------------------------------------------------------------------------------------------------
# distribution tests


@pytest.mark.parametrize("k", [1, 2, 3])
def test_rejection_sample_emits_target_distribution(k, chi2_pvalue):
    counts, num_accepted, p = _run(rejection_sample, k, NUM_DRAWS, seed=100 + k)
    # both paths are exercised: rejections (recovered token) and full acceptance (bonus token)
    assert num_accepted[0] > 0.1 * NUM_DRAWS
    assert num_accepted[k] > 0.02 * NUM_DRAWS
    # token 7 has p_i = 0 at every draft position: it is drafted often but must never be emitted there
    assert counts[:k, 7].sum() == 0
    # token 0 has q_0 = 0: at position 0 only the residual can produce it, with the right frequency
    assert counts[0, 0] > 0
    pvals = _positions_pvalues(chi2_pvalue, counts, p)
    assert 0 in pvals and (k == 1 or 1 in pvals), pvals
    for pos, pv in pvals.items():
        assert pv > ALPHA, f"position {pos}: p-value {pv:.3g}, counts {counts[pos].tolist()}"


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sample_one_hot_draft(k, chi2_pvalue):
    """draft_probs=None: a greedy draft under a sampling target (q is one-hot at the draft token)."""
    draft_token = 2  # p_0(2) = 0.15, p_1(2) = 0.40: accepted sometimes
    draws = 12_000
    counts, num_accepted, p = _run(rejection_sample, k, draws, seed=7 + k, one_hot_draft=draft_token)
    assert 0.1 * draws < num_accepted[0] < 0.95 * draws
    pvals = _positions_pvalues(chi2_pvalue, counts, p, min_rounds=1000)
    assert 0 in pvals and 1 in pvals
    for pos, pv in pvals.items():
        assert pv > ALPHA, f"position {pos}: p-value {pv:.3g}, counts {counts[pos].tolist()}"


def test_one_hot_draft_on_zero_probability_token_is_always_rejected():
    g = torch.Generator().manual_seed(0)
    p = torch.stack([P_ROWS[0], P_ROWS[3]])
    for _ in range(200):
        n, tok = rejection_sample(torch.tensor([7]), None, p, g)
        assert n == 0 and tok != 7


@pytest.mark.parametrize(
    "broken", [accept_always, _return_draft_token, recover_from_p, _accept_if_p_positive], ids=lambda f: f.__name__
)
def test_negative_control_broken_samplers_are_detected(broken, chi2_pvalue):
    """The same statistical check fails for samplers that are not lossless."""
    k = 2
    counts, _, p = _run(broken, k, NUM_DRAWS // 4, seed=100 + k)
    pv = chi2_pvalue(counts[0], p[0])
    assert pv < REJECT, f"{broken.__name__} was not detected (p-value {pv:.3g})"


def test_negative_control_one_hot_draftaccept_always(chi2_pvalue):
    counts, _, p = _run(accept_always, 1, NUM_DRAWS // 4, seed=3, one_hot_draft=2)
    assert chi2_pvalue(counts[0], p[0]) < REJECT


def test_rejection_sample_identical_p_and_q_accepts_everything():
    g = torch.Generator().manual_seed(0)
    q = torch.stack(Q_ROWS)
    p = torch.cat([q, P_ROWS[3][None]])
    drafts = torch.multinomial(q, 500, replacement=True, generator=g).T
    for d in drafts:
        n, _ = rejection_sample(d.contiguous(), q, p, g)
        assert n == 3


def test_rejection_sample_seeded_is_reproducible():
    p = torch.stack(P_ROWS)
    q = torch.stack(Q_ROWS)
    draft = torch.tensor([1, 4, 6])
    runs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(1234)
        runs.append([rejection_sample(draft, q, p, g) for _ in range(50)])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1


def test_rejection_sample_deterministic_cases():
    one_hot = lambda i: torch.nn.functional.one_hot(torch.tensor(i), VOCAB).float()  # noqa: E731
    # target certain of 5, draft certain of 2 -> reject, recover 5
    p = torch.stack([one_hot(5), one_hot(1)])
    assert rejection_sample(torch.tensor([2]), one_hot(2)[None], p, None) == (0, 5)
    # target agrees with a certain draft -> accept, bonus from p_1
    p = torch.stack([one_hot(2), one_hot(3), one_hot(4)])
    q = torch.stack([one_hot(2), one_hot(3)])
    assert rejection_sample(torch.tensor([2, 3]), q, p, None) == (2, 4)
    assert rejection_sample(torch.tensor([2, 3]), None, p, None) == (2, 4)
    # second draft rejected
    assert rejection_sample(torch.tensor([2, 6]), None, p, None) == (1, 3)
    # no drafts: just sample the bonus from p_0
    assert rejection_sample(torch.tensor([], dtype=torch.long), None, one_hot(6)[None], None) == (0, 6)


# --------------------------------------------------------------------------------------------------
# greedy


@pytest.mark.parametrize(
    "draft, argmax, expected",
    [
        ([1, 2, 3], [1, 2, 3, 4], (3, 4)),  # all accepted, bonus = last argmax
        ([1, 5, 3], [1, 2, 3, 4], (1, 2)),  # first mismatch at 1: recovered = target's argmax there
        ([9, 2, 3], [1, 2, 3, 4], (0, 1)),  # mismatch at 0 even though later positions match
        ([7], [7, 8], (1, 8)),
        ([6], [7, 8], (0, 7)),
        ([], [5], (0, 5)),  # no drafts: the target's own next token
    ],
)
def test_greedy_accept(draft, argmax, expected):
    got = greedy_accept(torch.tensor(draft, dtype=torch.long), torch.tensor(argmax, dtype=torch.long))
    assert got == expected
    assert all(isinstance(x, int) for x in got)
