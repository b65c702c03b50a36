"""Speculative SAMPLING stays lossless when the draft speaks another vocabulary (Token-Level Intersection).

The pair: a tiny random Llama TARGET over Gemma-3's tokenizer (262,144 ids) and a tiny random Llama
DRAFT over SmolLM2's tokenizer (49,152 ids), wired by ``specdec.LLM`` exactly as for real models (its
``load_model`` is pointed at the in-memory models, so nothing is written to disk). After a fixed prompt:

* the target's next-token logits are pinned on 8 common words, so with top_k=8 the exact target
  distribution p of the first generated token has a small, known support;
* the draft's logits (on its own re-tokenization of the prompt) are pinned on 5 of those words, with
  other weights, and on 3 words OUTSIDE p's support: its proposals are sometimes accepted, sometimes
  rejected (q > p, and p = 0), so both the accept and the recover paths run.

Each sample is one propose + one verify through the LLM's own DraftWorker(tli=TLIAdapter) and
TargetWorker (batched over many seeded sequences); the first emitted token must follow p (Pearson
chi-square), under both rules of seeded requests (the coupled race, where the draft races over q in
target ids, and rejection sampling). Negative controls: the same statistic rejects two broken
acceptance rules (of rejection sampling). With the coupled rule, the pair's seeded output is the target
alone's.
"""

from __future__ import annotations

import collections

import pytest
import torch

import specdec.engine.workers
from specdec import SamplingParams
from specdec.calls import ProposeCall, VerifyCall
from specdec.sampling import process_logits
from specdec.tli.adapter import TLIAdapter
from specdec.drafting_state import DraftingState
from tests.specdec.tli.tiny_tli import last_logits, llm_over, pin_next_token_logits, real_tokenizers, tiny_llama
from tests.broken_samplers import accept_always, recover_from_p, rowwise

PROMPT = "The quick brown fox"
TOP_K = 8
PARAMS = SamplingParams(temperature=1.0, top_k=TOP_K)
# target: the 8 words of p's support (top_k=8) and their logits after PROMPT
TARGET_LOGITS = {" the": 10.0, " of": 9.5, " and": 9.2, " to": 9.0, " in": 8.5, " is": 8.0, " that": 7.5, " for": 7.0}
# draft: 5 of them, weighted differently, + 3 words p gives 0; greedy drafting proposes " of" (p ~ 0.21)
DRAFT_LOGITS = {" of": 14.5, " with": 14.0, " in": 13.5, " the": 13.0, " on": 13.0, " and": 12.5, " to": 12.0, " as": 12.0}
ALPHA = 1e-3  # chi-square: the real sampler must keep p >= ALPHA, a broken one must fall below it
SEQS = 32  # sequences per batched round (distinct seeds)


def _single_id(tokenizer, word: str) -> int:
    ids = tokenizer(word, add_special_tokens=False).input_ids
    assert len(ids) == 1, f"{word!r} is not one token: {ids}"
    return ids[0]


class Pair:
    """The tiny TLI pair, its LLM, and the exact target distribution of the first generated token."""

    def __init__(self):
        self.target_tok, self.draft_tok = real_tokenizers()
        tt, dt = self.target_tok, self.draft_tok
        self.target = tiny_llama(len(tt), seed=0, bos=tt.bos_token_id, eos=tt.eos_token_id, pad=tt.pad_token_id)
        self.draft = tiny_llama(len(dt), seed=1, bos=dt.bos_token_id, eos=dt.eos_token_id, pad=dt.pad_token_id)
        self.prompt_ids = list(tt(PROMPT).input_ids)
        # what the draft reads: the prompt's text re-tokenized by SmolLM2 (the adapter LLM builds does the same)
        self.draft_prompt_ids = TLIAdapter(dt, tt, len(tt)).draft_history(DraftingState(), self.prompt_ids)
        pin_next_token_logits(self.target, self.prompt_ids, {_single_id(tt, w): v for w, v in TARGET_LOGITS.items()})
        pin_next_token_logits(self.draft, self.draft_prompt_ids, {_single_id(dt, w): v for w, v in DRAFT_LOGITS.items()})
        self.support = sorted(_single_id(tt, w) for w in TARGET_LOGITS)
        self.p = process_logits(last_logits(self.target, self.prompt_ids), PARAMS)  # [262144]
        self.llm = llm_over(self.target, tt, self.draft, dt, k=2)

    def sample_first_tokens(self, method: str, k: int, rounds: int, seed: int):
        """``SEQS * rounds`` first emitted tokens; each: one propose + one verify of a seeded sequence.

        ``method`` "greedy" drafts with text proposals (the default), "greedy-intersection" with
        intersection tokens only, "probabilistic" samples intersection tokens with q."""
        draft_w, target_w = self.llm._draft_worker, self.llm._target_worker
        draft_w.tli.proposals = "intersection" if method == "greedy-intersection" else "text"
        method = "greedy" if method == "greedy-intersection" else method
        counts: collections.Counter = collections.Counter()
        first_accepted = accepted = drafted = 0
        sids: list[str] = []
        try:
            for r in range(rounds):
                # Each sample is a new seeded sequence: a seeded sequence's draws are a function of
                # (seed, position), so re-running one at the same position would repeat its sample.
                sids = [f"{method}-{seed}-{r}-{i}" for i in range(SEQS)]
                params = [PARAMS.clone(seed=seed + r * SEQS + i) for i in range(SEQS)]
                proposals = draft_w.propose_batch(
                    [ProposeCall(s, self.prompt_ids, k, p, draft_sample_method=method) for s, p in zip(sids, params)])
                results = target_w.verify_batch(
                    [VerifyCall(s, self.prompt_ids, prop, p) for s, prop, p in zip(sids, proposals, params)])
                for prop, res in zip(proposals, results):
                    assert not isinstance(prop, BaseException) and not isinstance(res, BaseException), (prop, res)
                    n_drafted = len(prop.draft_token_ids)
                    assert n_drafted == k if draft_w.tli.proposals == "intersection" or method != "greedy" else 1 <= n_drafted <= 2 * k
                    counts[res.emitted(prop.draft_token_ids)[0]] += 1
                    first_accepted += res.num_accepted_tokens >= 1
                    accepted += res.num_accepted_tokens
                    drafted += n_drafted
                for s in sids:
                    draft_w.release(s)
                    target_w.release(s)
        finally:
            draft_w.tli.proposals = "text"
            for s in sids:
                draft_w.release(s)
                target_w.release(s)
        n = SEQS * rounds
        return counts, first_accepted / n, accepted / drafted

    def pvalue(self, chi2_pvalue, counts) -> float:
        """Chi-square p-value of the counts against p (a token outside p's support gives 0)."""
        outside = sum(c for t, c in counts.items() if t not in self.support)
        observed = [counts.get(t, 0) for t in self.support] + [outside]
        expected = [float(self.p[t]) for t in self.support] + [0.0]
        return chi2_pvalue(observed, expected)


@pytest.fixture(scope="module")
def pair() -> Pair:
    return Pair()


def test_pair_is_wired_through_tli(pair):
    """LLM built a TLI draft worker for the tiny pair; p has the designed 8-token support."""
    worker = pair.llm._draft_worker
    assert isinstance(worker.tli, TLIAdapter)
    assert worker.runner.logits_vocab_size == len(pair.draft_tok)  # the draft keeps its own logits
    assert pair.llm._target_worker.runner.logits_vocab_size == len(pair.target_tok)
    assert pair.p.nonzero().flatten().tolist() == pair.support
    assert abs(float(pair.p.sum()) - 1) < 1e-5 and float(pair.p[pair.support].min()) > 0.01


def test_probabilistic_proposal_q_is_the_restricted_draft_distribution_in_target_ids(pair):
    """q of the first draft position: the draft's processed distribution over the intersection, renormalised,
    indexed by target id; the proposed token is a target id with q > 0."""
    worker = pair.llm._draft_worker
    params = PARAMS.clone(seed=7)
    prop = worker.propose_batch([ProposeCall("q-check", pair.prompt_ids, 2, params, "probabilistic")])[0]
    worker.release("q-check")
    assert prop.draft_probs is not None and tuple(prop.draft_probs.shape) == (2, len(pair.target_tok))
    torch.testing.assert_close(prop.draft_probs.sum(-1), torch.ones(2), atol=1e-5, rtol=0)
    for tok, q in zip(prop.draft_token_ids, prop.draft_probs):
        assert float(q[tok]) > 0
    # Independent reference: softmax of the 8 pinned draft logits (top_k=8 keeps exactly them), each
    # at the target id of the same word.
    values = torch.softmax(torch.tensor(list(DRAFT_LOGITS.values())), 0)
    want = torch.zeros(len(pair.target_tok))
    for word, v in zip(DRAFT_LOGITS, values):
        want[_single_id(pair.target_tok, word)] = v
    torch.testing.assert_close(prop.draft_probs[0], want, atol=1e-5, rtol=0)
    expected_support = sorted(_single_id(pair.target_tok, w) for w in DRAFT_LOGITS)
    assert prop.draft_probs[0].nonzero().flatten().tolist() == expected_support


@pytest.mark.heavy
@pytest.mark.parametrize("seeded_sampling", ["coupled", "rejection"])
@pytest.mark.parametrize("method, k, rounds", [("greedy", 3, 20), ("greedy-intersection", 3, 20), ("probabilistic", 2, 20)])
def test_first_token_follows_target_distribution(pair, chi2_pvalue, monkeypatch, method, k, rounds, seeded_sampling):
    monkeypatch.setattr(pair.llm._target_worker, "seeded_sampling", seeded_sampling)
    counts, first_acc, acc = pair.sample_first_tokens(method, k, rounds, seed=10_000)
    # both paths of the acceptance rule ran: accepted first drafts AND rejected ones
    assert 0.0 < first_acc < 1.0 and 0.0 < acc < 1.0, (first_acc, acc)
    pv = pair.pvalue(chi2_pvalue, counts)
    n = sum(counts.values())
    table = {pair.target_tok.decode([t]): (c / n, round(float(pair.p[t]), 3)) for t, c in counts.most_common()}
    assert pv >= ALPHA, f"{method}: first tokens do not follow p (chi-square p={pv:.2e}): {table}"


@pytest.mark.heavy
@pytest.mark.parametrize("broken, method", [(accept_always, "probabilistic"), (recover_from_p, "greedy")])
def test_negative_control_broken_acceptance_is_detected(pair, chi2_pvalue, monkeypatch, broken, method):
    """The same statistic, on samples from a broken acceptance rule, must reject."""
    monkeypatch.setattr(specdec.engine.workers, "accept_batch", rowwise(broken))
    monkeypatch.setattr(pair.llm._target_worker, "seeded_sampling", "rejection")  # the rule these break
    counts, _, _ = pair.sample_first_tokens(method, 2, rounds=10, seed=20_000)
    pv = pair.pvalue(chi2_pvalue, counts)
    assert pv < ALPHA, f"{broken.__name__}: a broken sampler passed the chi-square test (p={pv:.2e})"


def test_llm_generate_samples_within_target_support(pair):
    """The offline API end to end (new sequence per request, prefill, TLI re-tokenization): seeded sampling
    is reproducible and the first token is always one the target could sample."""
    prompts = [PROMPT] * 6
    params = [PARAMS.clone(seed=s, max_tokens=2, ignore_eos=True) for s in range(6)]
    outs = pair.llm.generate(prompts, params)
    again = pair.llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]
    for out in outs:
        assert out.prompt_token_ids == pair.prompt_ids
        ids = out.outputs[0].token_ids
        assert len(ids) == 2 and ids[0] in pair.support, ids
        assert out.outputs[0].spec_decode_stats.num_draft_tokens >= 1


def test_coupled_output_is_the_target_alone_output(pair):
    """Seeded sampling under the coupled rule: the TLI pair (probabilistic drafting: the draft races over q
    in target ids and maps the winner back to its own id) emits exactly what the target alone emits."""
    alone = llm_over(pair.target, pair.target_tok)
    prompts = [PROMPT] * 4
    params = [PARAMS.clone(seed=s, max_tokens=6, ignore_eos=True) for s in range(4)]
    spec = llm_over(pair.target, pair.target_tok, pair.draft, pair.draft_tok, k=2, draft_sample_method="probabilistic")
    outs = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone.generate(prompts, params)]
    stats = [o.outputs[0].spec_decode_stats for o in outs]
    assert sum(s.num_draft_tokens for s in stats) > 0 and sum(s.num_accepted_tokens for s in stats) > 0


def test_to_draft_inverts_to_target(pair):
    tli = pair.llm._draft_worker.tli
    for word in DRAFT_LOGITS:
        d = _single_id(pair.draft_tok, word)
        assert tli.to_draft(tli.to_target(d)) == d
    outside = int((tli.mapping.target_to_draft < 0).nonzero()[0, 0])
    with pytest.raises(ValueError, match="not in the draft/target intersection"):
        tli.to_draft(outside)
