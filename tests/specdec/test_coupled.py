"""The coupled rule (specdec.rejection.coupled_accept with specdec.seeding.race_noise).

Decisions: for any proposal (random drafts, the target's own choices, none) the emitted tokens are the
target-alone choices argmax p_t / E_t, and the batched paths (``accept_batch``, ``accept_rows``) decide a
coupled row, built as a greedy row of p / E, the same way.

Distribution: fixed target distributions p_0..p_k (they do not depend on the prefix, a special case of
the real algorithm), a draft that races over its own q with the same noise, many seeds; the tokens
emitted at each position (decoding in rounds until 3 tokens) must follow p there (Pearson chi-square), and
the tokens at two positions must be independent (joint chi-square against p_0 x p_1). Negative controls: the same statistics must reject
(a) noise reused across positions (each position is still a correct race, but the positions are
dependent: only the joint test can see it) and (b) a rule that takes the draft's race over q as the
target's choice (the output follows q).
"""

from __future__ import annotations

import pytest
import torch

from specdec.rejection import RaggedBatch, accept_batch, accept_rows, coupled_accept, race_scores
from specdec.seeding import race_noise
from tests.specdec.test_rejection import P_ROWS, Q_ROWS, VOCAB

NUM_SEEDS = 12_000
ALPHA = 1e-3
REJECT = 1e-8
START = 17  # the absolute position of the first token chosen (the prompt's length)


def _target_alone(p: torch.Tensor, noise: torch.Tensor) -> list[int]:
    """What the target decodes alone from this noise, one position at a time."""
    return [int((p[j] / noise[j]).argmax()) for j in range(p.shape[0])]


def _random_p(k: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    p = torch.softmax(3 * torch.randn(k + 1, vocab, generator=g), -1)
    p[p < 0.01] = 0  # top-p-like zeros, as processed distributions have
    return p / p.sum(-1, keepdim=True)


@pytest.mark.parametrize("k", [0, 1, 3, 5])
@pytest.mark.parametrize("proposal", ["random", "target's own", "first right then random"])
def test_decisions_are_the_target_alone_choices(k, proposal):
    g = torch.Generator().manual_seed(k)
    for seed in range(200):
        vocab = 50 + seed
        p = _random_p(k, vocab, g)
        noise = race_noise(seed, range(START, START + k + 1), vocab)
        alone = _target_alone(p, noise)
        if proposal == "random":
            drafts = torch.randint(0, vocab, (k,), generator=g).tolist()
        elif proposal == "target's own":
            drafts = alone[:k]
        else:
            drafts = alone[:1] + torch.randint(0, vocab, (max(k - 1, 0),), generator=g).tolist()
            drafts = drafts[:k]
        n, nxt = coupled_accept(torch.tensor(drafts, dtype=torch.long), p, noise)
        expected_n = next((j for j in range(k) if drafts[j] != alone[j]), k)
        assert (n, nxt) == (expected_n, alone[expected_n])
        assert drafts[:n] + [nxt] == alone[:n + 1]  # what was emitted is what the target alone emits
        if proposal == "target's own":
            assert n == k


@pytest.mark.parametrize("accept", [accept_batch, accept_rows], ids=["accept_batch", "accept_rows"])
def test_batched_paths_decide_coupled_rows_as_the_reference(accept):
    """A coupled row goes into RaggedBatch as a greedy row whose target rows are p / E (as TargetWorker does),
    beside ordinary sampled and greedy rows."""
    g = torch.Generator().manual_seed(5)
    vocab, ks = 300, [3, 0, 2, 5, 1]
    kinds = ["coupled", "sampled", "coupled", "greedy", "coupled"]
    drafts, targets, expected, qs = [], [], {}, []
    for i, (k, kind) in enumerate(zip(ks, kinds)):
        p = _random_p(k, vocab, g)
        d = torch.randint(0, vocab, (k,), generator=g)
        if kind == "coupled":
            noise = race_noise(40 + i, range(START, START + k + 1), vocab)
            d[: k // 2] = (p / noise).argmax(-1)[: k // 2]  # some accepts, then (mostly) a mismatch
            expected[i] = coupled_accept(d, p, noise)
            p = race_scores(p, noise)
        drafts.append(d.tolist())
        targets.append(p)
        qs.append(None)
    gens = [torch.Generator().manual_seed(i) for i in range(len(ks))]
    batch = RaggedBatch.build(drafts, targets, qs, [kind != "sampled" for kind in kinds], gens, "cpu")
    n, nxt = accept(batch).tolist()
    for i, (en, enext) in expected.items():
        assert (n[i], nxt[i]) == (en, enext), i


# --------------------------------------------------------------------------------------------------
# distribution


def _coupled_draft(q: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The coupled draft: argmax q_j / E_j at each drafted position (an exact sample of q_j)."""
    return (q / noise[: q.shape[0]]).argmax(-1)


def _broken_noise_reused(seed, positions, vocab):
    """BROKEN: one noise row for every position (the position left out of the key)."""
    row = race_noise(seed, [START], vocab)
    return row.expand(len(list(positions)), vocab)


def _broken_draft_race_is_the_choice(draft, p, noise, q):
    """BROKEN: takes the draft's race over q as the target's choice (every draft is 'accepted'); the
    bonus comes from p."""
    k = draft.shape[0]
    return k, int((p[k] / noise[k]).argmax())


def _p_at(t: int) -> torch.Tensor:
    """The target's p at absolute position t (fixed rows: they do not depend on the prefix)."""
    return P_ROWS[min(t - START, len(P_ROWS) - 1)]


def _q_at(t: int) -> torch.Tensor:
    return Q_ROWS[min(t - START, len(Q_ROWS) - 1)]


def _decode(k: int, seed: int, length: int, noise_fn, rule) -> tuple[list[int], int]:
    """Decode ``length`` tokens from position START in rounds of k coupled drafts; (tokens, accepted)."""
    emitted, accepted = [], 0
    while len(emitted) < length:
        t = START + len(emitted)
        p = torch.stack([_p_at(t + j) for j in range(k + 1)])
        q = torch.stack([_q_at(t + j) for j in range(k)]) if k else torch.empty(0, VOCAB)
        noise = noise_fn(seed, range(t, t + k + 1), VOCAB)
        draft = _coupled_draft(q, noise)
        n, nxt = rule(draft, p, noise, q) if rule else coupled_accept(draft, p, noise)
        emitted += draft[:n].tolist() + [nxt]
        accepted += n
    return emitted[:length], accepted


def _run(k: int, num_seeds: int, first_seed: int, noise_fn=race_noise, rule=None, length: int = 3):
    """Per seed, decode ``length`` tokens. → counts per position [length, VOCAB], the pair counts of
    positions 0 and 1 [VOCAB, VOCAB], the target rows [length, VOCAB], drafts accepted."""
    counts = torch.zeros(length, VOCAB, dtype=torch.long)
    pairs = torch.zeros(VOCAB, VOCAB, dtype=torch.long)
    accepted = 0
    for seed in range(first_seed, first_seed + num_seeds):
        tokens, n = _decode(k, seed, length, noise_fn, rule)
        for pos, tok in enumerate(tokens):
            counts[pos, tok] += 1
        pairs[tokens[0], tokens[1]] += 1
        accepted += n
    return counts, pairs, torch.stack([_p_at(START + j) for j in range(length)]), accepted


def _joint_pvalue(chi2_pvalue, pairs, p0, p1):
    return chi2_pvalue(pairs.flatten(), (p0[:, None] * p1[None, :]).flatten())


@pytest.mark.heavy
@pytest.mark.parametrize("k", [1, 3])
def test_coupled_rule_emits_the_target_distribution(k, chi2_pvalue):
    counts, pairs, p, accepted = _run(k, NUM_SEEDS, first_seed=1000 * k)
    assert 0.1 * NUM_SEEDS < accepted < 2 * NUM_SEEDS  # drafts are accepted and rejected
    for pos in range(p.shape[0]):
        pv = chi2_pvalue(counts[pos], p[pos])
        assert pv > ALPHA, (pos, pv, counts[pos])
    assert int(counts[:2, 7].sum()) == 0  # p_0, p_1 give token 7 no mass; the draft proposes it often
    pv = _joint_pvalue(chi2_pvalue, pairs, p[0], p[1])
    assert pv > ALPHA, pv


def test_target_alone_emits_the_target_distribution(chi2_pvalue):
    counts, pairs, p, accepted = _run(0, NUM_SEEDS, first_seed=50_000, length=2)
    assert accepted == 0
    assert chi2_pvalue(counts[0], p[0]) > ALPHA and chi2_pvalue(counts[1], p[1]) > ALPHA
    assert _joint_pvalue(chi2_pvalue, pairs, p[0], p[1]) > ALPHA


def test_negative_control_noise_reused_across_positions(chi2_pvalue):
    """Each position is still a correct race, so the per-position test passes; the joint test must not."""
    counts, pairs, p, _ = _run(3, NUM_SEEDS // 4, first_seed=7000, noise_fn=_broken_noise_reused)
    assert chi2_pvalue(counts[0], p[0]) > ALPHA  # the marginal alone cannot see this bug
    assert _joint_pvalue(chi2_pvalue, pairs, p[0], p[1]) < REJECT


def test_negative_control_draft_choice_is_detected(chi2_pvalue):
    counts, _, p, _ = _run(2, NUM_SEEDS // 4, first_seed=9000, rule=_broken_draft_race_is_the_choice)
    assert chi2_pvalue(counts[0], p[0]) < REJECT
