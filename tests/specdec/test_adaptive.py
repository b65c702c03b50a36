"""Adaptive k (specdec.adaptive): the choice follows acceptance and cost, the estimate follows a
sequence's rounds, calibration measures real calls, and any k choice stays lossless."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specdec import LLM, SamplingParams
from specdec.adaptive import AdaptiveK, RoundCosts, calibrate, expected_tokens
from specdec.sampling import SpecDecodeStats

REPEATING = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"


def test_expected_tokens_of_a_round():
    assert expected_tokens(0.0, 4) == 1.0  # nothing accepted: the recovered token alone
    assert expected_tokens(1.0, 4) == 5.0  # everything accepted, plus the bonus
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_best_k_follows_acceptance_and_cost():
    # a target pass costs 10 (+1 per extra token), a draft step 2: a GPU-like verify, a cheap draft
    costs = RoundCosts([10 + k for k in range(9)], [2 * k for k in range(9)])
    ks = [costs.best_k(alpha, 8) for alpha in (0.1, 0.5, 0.8, 0.95)]
    assert ks == sorted(ks) and ks[0] == 1 and ks[-1] == 8
    # an expensive draft (as costly as the target pass) never pays at alpha 0.5: the fewest drafts
    dear = RoundCosts([10 + k for k in range(5)], [10 * k for k in range(5)])
    assert dear.best_k(0.5, 4) == 1 and dear.best_k(0.5, 4, min_k=0) == 0
    assert costs.best_k(0.95, 3) == 3  # capped by the request's / server's k
    # a cost that measured lower for more drafts (noise, or rounds a cheap lookup drafted) is read as no lower
    odd = RoundCosts([10, 12, 9, 13], [0, 5, 1, 9])  # k=2 "cheaper" than k=1
    assert odd.best_k(0.0, 3) == 1  # nothing is accepted: no reason for more drafts


def test_costs_follow_measured_calls():
    costs = RoundCosts([1.0, 1.0], [0.0, 1.0])
    for _ in range(50):
        costs.observe("propose", 1, 3.0)
        costs.observe("verify", 1, 2.0)
    costs.observe("verify", 7, 9.0)  # past k_max: ignored
    costs.observe("propose", 0, 9.0)  # no drafts cost nothing
    assert costs.propose == [0.0, pytest.approx(3.0, rel=0.02)]
    assert costs.verify == [1.0, pytest.approx(2.0, rel=0.02)]


def test_the_estimate_follows_the_sequences_rounds():
    costs = RoundCosts([10 + k for k in range(9)], [2 * k for k in range(9)])
    seq = SimpleNamespace(stats=SpecDecodeStats())
    policy = AdaptiveK(costs, 8)
    first = policy(seq)
    for _ in range(12):  # every draft accepted, round after round: k grows to the cap
        k = policy(seq)
        seq.stats.record(k, k)
    assert policy.alpha > 0.9 and policy.chosen[-1] == 8 > first
    for _ in range(12):  # then the text changes: the first draft is rejected every time
        k = policy(seq)
        seq.stats.record(k, 0)
    assert policy.alpha < 0.3 and policy.chosen[-1] == 1
    policy(seq)  # (counts the last round)
    seq.stats.record(0, 0)  # a round without drafts (k=0, or no lookup match) teaches nothing
    before = policy.alpha
    policy(seq)
    assert policy.alpha == before


def test_calibration_measures_each_k_and_releases_its_sequence(target_dir, good_draft_dir):
    llm = LLM(str(target_dir), speculative_config={"model": str(good_draft_dir), "num_speculative_tokens": 3},
              dtype="float32")
    costs = calibrate(llm._draft_worker, llm._target_worker, [1, 2, 3, 4, 5], 3, reps=2)
    assert len(costs.verify) == len(costs.propose) == 4 and costs.propose[0] == 0.0
    assert all(v > 0 for v in costs.verify) and all(p > 0 for p in costs.propose[1:])
    assert not llm._target_worker.runner.sequences and not llm._draft_worker.runner.sequences


@pytest.mark.heavy
@pytest.mark.parametrize("spec", [{"num_speculative_tokens": 4}, {"num_speculative_tokens": 4, "prompt_lookup_max": 3}],
                         ids=["model draft", "hybrid"])
def test_adaptive_k_greedy_equals_target_alone(target_dir, good_draft_dir, spec, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [REPEATING, "Hello", "def f(x):\n    return x\n\ndef g(x):\n    return"]
    alone = LLM(str(target_dir), dtype="float32").generate(prompts, params)
    chosen: list[int] = []
    pick = AdaptiveK.__call__
    monkeypatch.setattr(AdaptiveK, "__call__", lambda self, seq: (chosen.append(pick(self, seq)), chosen[-1])[1])
    llm = LLM(str(target_dir), speculative_config={"model": str(good_draft_dir), "adaptive_k": True, **spec},
              dtype="float32")
    outs = llm.generate(prompts, params)
    for ref, out in zip(alone, outs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert len(chosen) == sum(o.spec_decode_stats.num_target_passes for o in outs)  # consulted every round
    assert set(chosen) <= {1, 2, 3, 4}
