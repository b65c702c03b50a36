"""Penalties and biases stay lossless with speculation (the library, in-process workers).

* greedy: speculative output with presence / frequency / repetition penalties, logit_bias and
  min_tokens equals a plain reference loop (the target alone through transformers, token by token,
  with the penalties applied by an independent implementation below);
* sampled: the first two tokens (x, y) of speculative decoding with penalties follow the reference's
  p(x) p(y | prompt + x), by a chi-square test on the word pair of test_served_distribution (k = 1, so
  a round either accepts x and draws the bonus y from the SAME verify pass, whose row 1 must count x as
  generated, or rejects it and draws y in a round of its own), and two broken variants fail it:
  (e) the drafts before a row not counted as generated, (f) the prompt counted as generated.
"""

from __future__ import annotations

import collections
import random

import pytest
import torch

import specdec.engine.workers
from specdec import LLM, SamplingParams
from specdec.sampling import penalty_context
from tests.gateway.test_served_distribution import PROMPT_IDS, VOCAB, word_pair  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("cached_model_loading")

ALPHA = 1e-3
N_SAMPLES = 1200
N_NEGATIVE = 300
EOS = 2  # the word pair's </s>


def reference_logits(logits: torch.Tensor, prompt: list[int], generated: list[int], p: SamplingParams,
                     eos_ids=()) -> torch.Tensor:
    """An independent, plain-Python reading of vLLM's semantics for one position (float64)."""
    out = logits.double().clone()
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    if len(generated) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids)):
            out[t] = float("-inf")
    counts = collections.Counter(generated)
    if p.repetition_penalty != 1:
        for t in set(prompt) | set(generated):
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t, c in counts.items():
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    return out


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], p: SamplingParams, n: int, eos_ids=()) -> list[int]:
    generated: list[int] = []
    for _ in range(n):
        logits = model(torch.tensor([prompt + generated])).logits[0, -1]
        generated.append(int(reference_logits(logits, prompt, generated, p, eos_ids).argmax()))
    return generated


def test_each_row_of_a_block_is_penalised_as_the_target_alone_would():
    """apply_penalties over k + 1 rows = the reference position by position, with the drafts before each
    row counted as generated (and the prompt only for repetition)."""
    from specdec.sampling import apply_penalties

    g = torch.Generator().manual_seed(0)
    vocab, prompt, generated, drafts = 50, [3, 4, 5, 3], [7, 7, 9], [9, 11, 3]
    logits = torch.randn(len(drafts) + 1, vocab, generator=g) * 3
    p = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4, repetition_penalty=1.6,
                       logit_bias={11: 2.0, 12: -5.0}, min_tokens=5, stop_token_ids=[13], num_prompt_tokens=4)
    raw = logits.clone()
    got = apply_penalties(logits, p, penalty_context(p, prompt + generated, {EOS}, drafts))
    for j in range(len(drafts) + 1):
        want = reference_logits(logits[j], prompt, generated + drafts[:j], p, [EOS])
        assert torch.allclose(got[j].double(), want, atol=1e-5), j
    assert torch.equal(logits, raw)  # the raw logits (logprobs read them) are untouched


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (a -0.0 that became +0.0 counts as a difference)."""
    return torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


@pytest.mark.parametrize("seed", range(4))
def test_kept_counts_penalise_exactly_as_counting_the_whole_history(monkeypatch, seed):
    """The counts kept with a TokenHistory (brought up to date with what was appended or cut back since the
    last round) give the very logits counting the whole list gives: over random histories that grow, lose
    a tail (a lookahead's drafts) or are rewritten deeper than the ids kept to undo it (recounted), read as
    the history itself (the target: drafts per row) and as ``history + drafts`` or ``after=drafts`` (the
    draft's steps), with ids past the logits' width now and then (counted in full)."""
    from specdec.history import TokenHistory
    from specdec.sampling import PenaltyCounts, apply_penalties, apply_penalties_in_full

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    for trial in range(40):
        monkeypatch.setattr(PenaltyCounts, "TAIL", rng.choice([3, 1024]))
        vocab = rng.choice([6, 30])
        prompt_len = rng.randrange(12)
        p = SamplingParams(presence_penalty=rng.choice([0.0, 0.5, -1.0]), frequency_penalty=rng.choice([0.0, 0.3, -0.4]),
                           repetition_penalty=rng.choice([1.0, 1.3, 0.7]), logit_bias=rng.choice([None, {1: 2.0}]),
                           min_tokens=rng.choice([0, 3, 20]), max_tokens=100, stop_token_ids=[4],
                           num_prompt_tokens=prompt_len)
        if not p.has_penalties:
            continue
        history = TokenHistory(rng.randrange(vocab) for _ in range(prompt_len + rng.randrange(4)))
        for _ in range(20):
            if history and rng.random() < 0.35:
                history.truncate(rng.randrange(len(history) + 1))
            wide = rng.random() < 0.05  # an id the logits do not cover
            history.extend(rng.randrange(vocab + (3 if wide else 0)) for _ in range(rng.randrange(4)))
            drafts = [rng.randrange(vocab + 1) for _ in range(rng.randrange(4))]
            logits = torch.randn(len(drafts) + 1, vocab, generator=g) * 3
            logits[0, rng.randrange(vocab)] = -0.0
            got = apply_penalties(logits, p, penalty_context(p, history, {EOS}, drafts))
            want = apply_penalties_in_full(logits, p, penalty_context(p, list(history), {EOS}, drafts))
            assert _same(got, want)
            for j in range(len(drafts) + 1):  # the draft's steps: one row after history + drafts[:j]
                steps = history + drafts[:j]
                want = apply_penalties_in_full(logits[j], p, penalty_context(p, list(steps), {EOS}))
                assert _same(apply_penalties(logits[j], p, penalty_context(p, steps, {EOS})), want)
                # the same without copying the history: the drafts so far as ``after``
                assert _same(apply_penalties(logits[j], p, penalty_context(p, history, {EOS}, after=drafts[:j])), want)
                assert _same(apply_penalties_in_full(logits[j], p, penalty_context(p, list(history), {EOS},
                                                                                     after=drafts[:j])), want)


# Mixed signs: repeats are encouraged# Mixed signs: repeats are encouraged (presence < 0, repetition < 1), then pushed back as counts grow.
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=-1.0, frequency_penalty=0.5,
                        repetition_penalty=0.8, logit_bias={30459: -100.0, 1000: 2.0}, min_tokens=4)


def test_greedy_with_penalties_equals_the_reference_loop(target_dir, good_draft_dir, target_model, tokenizer, spec):
    llm = LLM(str(target_dir), speculative_config=spec(good_draft_dir, 3), dtype="float32")
    prompt = tokenizer("The quick brown fox").input_ids
    (out,) = llm.generate({"prompt_token_ids": prompt}, GREEDY)
    gen = out.outputs[0]
    assert gen.spec_decode_stats.num_accepted_tokens >= 6, "multi-token blocks must be exercised"
    assert gen.token_ids == reference_greedy(target_model, prompt, GREEDY, GREEDY.max_tokens)
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert plain[0].outputs[0].token_ids != gen.token_ids, "the penalties must change the output"


# Strong enough that both broken variants move the joint far (total variation ~0.75 each, computed
# from the reference): repeats are encouraged, so y == x most of the time when x counts as generated.
SAMPLED = SamplingParams(temperature=1.0, max_tokens=2, presence_penalty=-2.0, frequency_penalty=-2.0,
                         repetition_penalty=0.5, logit_bias={50: 2.0}, min_tokens=2)


@pytest.fixture(scope="module")
def word_llm(word_pair):  # noqa: F811
    return LLM(str(word_pair.target_dir), speculative_config={
        "method": "draft_model", "model": str(word_pair.draft_dir), "num_speculative_tokens": 1,
        "draft_sample_method": "probabilistic"}, dtype="float32")


@pytest.fixture(scope="module")
def penalised_joint(word_pair):  # noqa: F811
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(word_pair.target_dir).eval()
    with torch.inference_mode():
        first = ref(torch.tensor([PROMPT_IDS])).logits[0, -1]
        second = ref(torch.tensor([PROMPT_IDS + [x] for x in range(VOCAB)])).logits[:, -1]
    p0 = torch.softmax(reference_logits(first, PROMPT_IDS, [], SAMPLED, [EOS]), -1)
    p1 = torch.stack([torch.softmax(reference_logits(second[x], PROMPT_IDS, [x], SAMPLED, [EOS]), -1)
                      for x in range(VOCAB)])
    return p0[:, None] * p1


def sample_pairs(llm, n: int, seed: int) -> tuple[torch.Tensor, int]:
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    accepted = 0
    for i in range(n):
        seq = llm.new_sequence(list(PROMPT_IDS), SAMPLED.clone(seed=seed + i))
        for _ in llm.stream(seq):
            pass
        x, y = seq.output_token_ids
        counts[x, y] += 1
        accepted += seq.stats.num_accepted_tokens
    return counts, accepted


@pytest.mark.heavy
def test_sampled_pairs_with_penalties_follow_the_target(word_llm, penalised_joint, chi2_pvalue):
    counts, accepted = sample_pairs(word_llm, N_SAMPLES, seed=10**6)
    assert 0.05 * N_SAMPLES < accepted < 0.95 * N_SAMPLES, f"both paths must run (accepted {accepted})"
    repeats = float(counts.diagonal().sum()) / N_SAMPLES
    assert repeats > 0.5, f"the penalties must matter inside the block (y == x in {repeats:.0%})"
    pv = chi2_pvalue(counts, penalised_joint)
    print(f"\nchi-square p={pv:.3g}; accepted {accepted}/{N_SAMPLES}; y == x in {repeats:.0%}")
    assert pv >= ALPHA, f"(x, y) do not follow the penalised target: chi-square p={pv:.2e}"


def _drafts_not_counted(params, token_ids, eos_token_ids, drafts=(), after=()):
    return penalty_context(params, token_ids, eos_token_ids)  # BROKEN: every row as if it were the first


def _prompt_counted(params, token_ids, eos_token_ids, drafts=(), after=()):
    return penalty_context(params.clone(num_prompt_tokens=0), token_ids, eos_token_ids, drafts, after=after)  # BROKEN


@pytest.mark.parametrize("broken", [_drafts_not_counted, _prompt_counted], ids=["e-drafts-not-counted",
                                                                               "f-prompt-counted"])
def test_negative_control_is_detected(word_llm, penalised_joint, chi2_pvalue, monkeypatch, broken):
    monkeypatch.setattr(specdec.engine.workers, "penalty_context", broken)
    counts, _ = sample_pairs(word_llm, N_NEGATIVE, seed=5 * 10**6)
    pv = chi2_pvalue(counts, penalised_joint)
    print(f"\n{broken.__name__}: chi-square p={pv:.3g}")
    assert pv < ALPHA, f"{broken.__name__}: a broken variant passed the chi-square test (p={pv:.2e})"
