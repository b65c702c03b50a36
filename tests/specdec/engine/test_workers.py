"""The engine: workers, KV-cache sync/rollback, and losslessness of the speculative loop.

* Greedy: speculative output is token-identical to Hugging Face ``generate`` of the target alone,
  for every k, both draft sample methods, good / bad / shallow drafts.
* Sampling: the distribution of the first two generated tokens (temperature 1, top-k, top-p) equals
  the target's processed distribution (chi-square), and a deliberately broken verifier is caught.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

import specdec.engine.workers as workers
from specdec import LLM, SamplingParams
from specdec.proposal import MAX_NUM_SPECULATIVE_TOKENS, Proposal, check_num_speculative_tokens
from specdec.engine.runner import ModelRunner
from specdec.calls import ProposeCall, VerifyCall
from specdec.engine.workers import DraftWorker, TargetWorker
from specdec.errors import InvalidRequestError, ResourceExhaustedError, SequenceNotFoundError
from specdec.engine.models import load_model
from specdec.sampling import process_logits
from specdec.sequence import SequenceState
from tests.broken_samplers import accept_always, rowwise

pytestmark = pytest.mark.usefixtures("cached_model_loading")

PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    return"]  # = conftest.PROMPTS
NUM_TOKENS = 24


def _greedy(max_tokens=NUM_TOKENS):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _greedy_for(draft_sample_method: str, max_tokens=NUM_TOKENS) -> SamplingParams:
    """Parameters whose output must equal greedy decoding, distinct per drafting method: at temperature 0
    probabilistic drafting drafts greedily (the greedy path again), so it runs at temperature 1 with
    top_k=1 instead, sampling from a one-hot q through the rejection sampler."""
    if draft_sample_method == "probabilistic":
        return SamplingParams(temperature=1.0, top_k=1, max_tokens=max_tokens, ignore_eos=True)
    return _greedy(max_tokens)


# --------------------------------------------------------------------------------------------------
# greedy losslessness


def _check_greedy_lossless(llm, target_greedy_ref, max_tokens=NUM_TOKENS, params: SamplingParams | None = None):
    outs = llm.generate(PROMPTS, params or _greedy(max_tokens))
    for prompt, out in zip(PROMPTS, outs):
        ids, ref = target_greedy_ref[prompt]
        assert out.prompt_token_ids == ids
        got = out.outputs[0]
        assert got.token_ids == ref[:max_tokens], prompt
        assert got.finish_reason == "length"
    return outs


def test_target_alone_equals_hf_generate(target_dir, target_greedy_ref):
    llm = LLM(str(target_dir), dtype="float32")
    outs = _check_greedy_lossless(llm, target_greedy_ref, max_tokens=32)
    stats = outs[0].spec_decode_stats
    assert stats.num_draft_tokens == 0 and stats.num_target_passes == 32


@pytest.mark.parametrize("draft_sample_method", ["greedy", "probabilistic"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_lossless_good_draft(k, draft_sample_method, target_dir, good_draft_dir, target_greedy_ref, spec):
    # the draft as built (its default int8 products lower a tiny random draft's agreement: see test_quant)
    llm = LLM(str(target_dir), speculative_config=spec(good_draft_dir, k, draft_sample_method=draft_sample_method,
                                                       quantization="none"), dtype="float32")
    outs = _check_greedy_lossless(llm, target_greedy_ref, params=_greedy_for(draft_sample_method))
    for out in outs:
        s = out.spec_decode_stats
        assert s.num_drafts > 0 and s.num_accepted_tokens > 0
        assert s.acceptance_rate > 0.3, s.as_dict()
        # speculation saved target passes: fewer passes than tokens
        assert s.num_target_passes < NUM_TOKENS
        assert s.num_accepted_tokens + s.num_target_passes == NUM_TOKENS  # drafting is capped by the budget


@pytest.mark.parametrize("draft_sample_method", ["greedy", "probabilistic"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_lossless_bad_draft(k, draft_sample_method, target_dir, bad_draft_dir, target_greedy_ref, spec):
    llm = LLM(str(target_dir), speculative_config=spec(bad_draft_dir, k, draft_sample_method=draft_sample_method), dtype="float32")
    num_tokens = 16  # (almost) every round yields one token: keep it short
    outs = _check_greedy_lossless(llm, target_greedy_ref, max_tokens=num_tokens,
                                  params=_greedy_for(draft_sample_method, num_tokens))
    for out in outs:
        s = out.spec_decode_stats
        assert s.num_draft_tokens > 0
        assert s.num_accepted_tokens < s.num_draft_tokens  # rejections happened
        assert s.acceptance_rate < 0.2, s.as_dict()
        assert s.num_target_passes == num_tokens - s.num_accepted_tokens


@pytest.mark.parametrize("k", [3, 8])
def test_greedy_lossless_shallow_draft(k, target_dir, shallow_draft_dir, target_greedy_ref, spec):
    llm = LLM(str(target_dir), speculative_config=spec(shallow_draft_dir, k), dtype="float32")
    outs = _check_greedy_lossless(llm, target_greedy_ref)
    assert sum(o.spec_decode_stats.num_draft_tokens for o in outs) > 0


def test_draft_identical_to_target_accepts_everything(target_dir, target_greedy_ref, spec):
    llm = LLM(str(target_dir), speculative_config=spec(target_dir, 4, quantization="none"), dtype="float32")
    outs = _check_greedy_lossless(llm, target_greedy_ref)
    for out in outs:
        s = out.spec_decode_stats
        assert s.num_accepted_tokens == s.num_draft_tokens > 0
        # 24 tokens in rounds of 5 (4 drafts + bonus); the last round drafts only what the budget allows
        assert s.num_target_passes == 5


def test_greedy_lossless_with_bf16_draft(target_dir, good_draft_dir, target_greedy_ref, spec):
    """The draft's precision changes acceptance, never the output."""
    llm = LLM(str(target_dir), speculative_config=spec(good_draft_dir, 4), dtype="float32", draft_dtype="bfloat16")
    assert llm.draft.dtype == torch.bfloat16 and llm.target.dtype == torch.float32
    outs = _check_greedy_lossless(llm, target_greedy_ref)
    assert outs[0].spec_decode_stats.num_accepted_tokens > 0


# --------------------------------------------------------------------------------------------------
# sampling losslessness: distribution of the first two tokens

SAMPLING_PROMPT = "The quick brown fox"  # target's first-token distribution at T=1: 0.43, 0.36, 0.08, ...


def _target_first_two(target_model, prompt_ids, params, first_tokens):
    """p(t1) and p(t2 | t1) for the given t1 candidates, from the target's own logits."""
    with torch.inference_mode():
        p1 = process_logits(target_model(torch.tensor([prompt_ids])).logits[0, -1], params)
        batch = torch.tensor([prompt_ids + [t] for t in first_tokens])
        p2 = process_logits(target_model(batch).logits[:, -1], params)
    return p1, {t: p2[i] for i, t in enumerate(first_tokens)}


def _joint_pvalue(chi2_pvalue, samples, p1, p2_given, min_count=5):
    """Chi-square of the (t1, t2) pairs against p(t1) p(t2 | t1).

    Cells: (a, b) for every a in p2_given and every b with expected count >= min_count, (a, other),
    and (every other first token, *).
    """
    n = len(samples)
    pairs = Counter(samples)
    firsts = Counter(t1 for t1, _ in samples)
    observed, probs = [], []
    for a, p2 in p2_given.items():
        pa = float(p1[a])
        big = [int(b) for b in torch.nonzero(pa * p2 * n >= min_count).flatten()]
        for b in big:
            observed.append(pairs[(a, b)])
            probs.append(pa * float(p2[b]))
        observed.append(firsts[a] - sum(pairs[(a, b)] for b in big))
        probs.append(pa * (1.0 - float(p2[big].sum())))
    observed.append(n - sum(firsts[a] for a in p2_given))
    probs.append(1.0 - sum(float(p1[a]) for a in p2_given))
    probs = [max(p, 0.0) for p in probs]
    return chi2_pvalue(observed, probs)


def _sample_first_two(llm, prompt, params, n):
    out = llm.generate(prompt, params.clone(n=n, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs) == n
    samples = [tuple(o.token_ids[:2]) for o in out.outputs]
    assert all(len(s) == 2 for s in samples)
    return samples, out.spec_decode_stats


SAMPLING_CASES = {
    # id: (draft fixture, k, draft_sample_method, sampling params, number of samples)
    "good-probabilistic-T1": ("good_draft_dir", 2, "probabilistic", SamplingParams(temperature=1.0, seed=11), 250),
    "good-greedydraft-T1": ("good_draft_dir", 2, "greedy", SamplingParams(temperature=1.0, seed=12), 200),
    "bad-probabilistic-topk4": ("bad_draft_dir", 2, "probabilistic", SamplingParams(temperature=1.0, top_k=4, seed=13), 150),
    "good-probabilistic-topp0.8-T0.8": (
        "good_draft_dir", 2, "probabilistic", SamplingParams(temperature=0.8, top_p=0.8, seed=14), 150,
    ),
}


@pytest.mark.heavy
@pytest.mark.parametrize("seeded_sampling", ["coupled", "rejection"])
@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_sampling_lossless_first_two_tokens(case, request, target_dir, target_model, tokenizer, spec, chi2_pvalue,
                                            seeded_sampling):
    draft_fixture, k, method, params, n = SAMPLING_CASES[case]
    draft_dir = request.getfixturevalue(draft_fixture)
    llm = LLM(str(target_dir), speculative_config=spec(draft_dir, k, draft_sample_method=method), dtype="float32",
              seeded_sampling=seeded_sampling)
    samples, stats = _sample_first_two(llm, SAMPLING_PROMPT, params, n)
    # speculation really happened, with both outcomes
    assert stats.num_draft_tokens > 0
    if draft_fixture == "good_draft_dir":
        assert 0.15 < stats.acceptance_rate < 1.0, stats.as_dict()
    else:
        assert stats.acceptance_rate < 0.5, stats.as_dict()
    prompt_ids = tokenizer(SAMPLING_PROMPT).input_ids
    firsts = Counter(s[0] for s in samples)
    top_firsts = [t for t, c in firsts.most_common(4) if c >= 20]
    p1, p2_given = _target_first_two(target_model, prompt_ids, params, top_firsts)
    pv_first = chi2_pvalue([firsts[t] for t in range(p1.numel())], p1)
    pv_joint = _joint_pvalue(chi2_pvalue, samples, p1, p2_given)
    assert pv_first > 1e-3, (pv_first, firsts.most_common(8), p1.topk(8))
    assert pv_joint > 1e-3, pv_joint
    if params.top_k:
        assert all(float(p1[t]) > 0 for t in firsts), "a token outside the top-k was emitted"


def test_sampling_target_alone_first_token(target_dir, target_model, tokenizer, chi2_pvalue):
    llm = LLM(str(target_dir), dtype="float32")
    params = SamplingParams(temperature=1.0, seed=21, n=150, max_tokens=1)
    out = llm.generate(SAMPLING_PROMPT, params)[0]
    firsts = Counter(o.token_ids[0] for o in out.outputs)
    with torch.inference_mode():
        p1 = process_logits(target_model(torch.tensor([tokenizer(SAMPLING_PROMPT).input_ids])).logits[0, -1], params)
    assert chi2_pvalue([firsts[t] for t in range(p1.numel())], p1) > 1e-3


def test_negative_control_lossy_verifier_is_detected(
    monkeypatch, target_dir, bad_draft_dir, target_model, tokenizer, spec, chi2_pvalue
):
    """The same statistical check rejects a verifier that accepts every draft."""
    monkeypatch.setattr(workers, "accept_batch", rowwise(accept_always))
    params = SamplingParams(temperature=1.0, seed=11)
    llm = LLM(str(target_dir), speculative_config=spec(bad_draft_dir, 2, draft_sample_method="probabilistic"),
              dtype="float32", seeded_sampling="rejection")  # accept_always breaks rejection sampling
    samples, stats = _sample_first_two(llm, SAMPLING_PROMPT, params, 100)
    assert stats.acceptance_rate == 1.0
    firsts = Counter(s[0] for s in samples)
    prompt_ids = tokenizer(SAMPLING_PROMPT).input_ids
    top_firsts = [t for t, c in firsts.most_common(4) if c >= 20]
    p1, p2_given = _target_first_two(target_model, prompt_ids, params, top_firsts)
    assert chi2_pvalue([firsts[t] for t in range(p1.numel())], p1) < 1e-8
    assert _joint_pvalue(chi2_pvalue, samples, p1, p2_given) < 1e-8


def test_negative_control_coupled_noise_without_the_seed_is_detected(
    monkeypatch, target_dir, good_draft_dir, target_model, tokenizer, spec, chi2_pvalue
):
    """The same check rejects a coupled rule whose noise leaves the seed out of its key (every request
    races with the same numbers). Noise reused across positions is caught in tests/specdec/test_coupled.py."""
    from specdec.seeding import race_noise

    def noise_without_seed(seed, positions, vocab, device="cpu"):
        return race_noise(0, positions, vocab, device)

    monkeypatch.setattr(workers, "race_noise", noise_without_seed)
    params = SamplingParams(temperature=1.0, seed=11)
    llm = LLM(str(target_dir), speculative_config=spec(good_draft_dir, 2, draft_sample_method="probabilistic"),
              dtype="float32")
    samples, _ = _sample_first_two(llm, SAMPLING_PROMPT, params, 100)
    firsts = Counter(s[0] for s in samples)
    p1, _ = _target_first_two(target_model, tokenizer(SAMPLING_PROMPT).input_ids, params, list(firsts)[:1])
    assert chi2_pvalue([firsts[t] for t in range(p1.numel())], p1) < 1e-8


# --------------------------------------------------------------------------------------------------
# workers and the model runner


@pytest.fixture(scope="module")
def draft_lm(good_draft_dir):
    return load_model(str(good_draft_dir), dtype="float32")


def _ids(n, seed=0):
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_runner_sync_feeds_only_the_missing_suffix(target_lm):
    runner = ModelRunner(target_lm, max_model_len=128, role="target")
    seq = runner.get_or_create("s", seed=0)
    a = _ids(10, 1)
    assert runner.sync(seq, a) == a
    runner.forward(seq, a)
    assert seq.tokens == a and seq.length == 10
    # extension: only the new tokens
    assert runner.sync(seq, a + [5, 6]) == [5, 6]
    # identical history: the last token is recomputed, so there are logits to return
    assert runner.sync(seq, a) == a[-1:]
    assert seq.length == 9 and seq.tokens == a[:9]
    runner.forward(seq, a[-1:])
    # divergence in the middle: roll back to the common prefix
    b = a[:4] + [7, 8]
    assert runner.sync(seq, b) == [7, 8]
    assert seq.length == 4 and seq.tokens == a[:4]
    # a shorter history: rolled back
    assert runner.sync(seq, a[:2]) == a[1:2]
    assert seq.length == 1


def test_runner_forward_matches_fresh_and_tracks_cache(target_lm):
    runner = ModelRunner(target_lm, max_model_len=128, role="target")
    seq = runner.get_or_create("s", seed=0)
    ids = _ids(20, 2)
    runner.forward(seq, ids[:12])
    logits = runner.forward(seq, ids[12:], num_logits=3)
    assert logits.shape == (3, 49152) and logits.dtype == torch.float32
    with torch.inference_mode():
        fresh = target_lm.model(torch.tensor([ids])).logits[0, -3:]
    torch.testing.assert_close(logits, fresh, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n,num_logits", [(2, 2), (3, 3), (3, 1), (2, 1)])
def test_runner_pads_short_queries_without_changing_results(target_lm, n, num_logits):
    """fp32 on CPU without SkinnyLinear: a 2-3 token pass runs as 4 rows (a faster matmul path); the
    padding is scored and dropped, so logits, the cache and the tokens are those of the unpadded pass."""
    padded = ModelRunner(target_lm, max_model_len=128, role="target", min_query_tokens=4)
    plain = ModelRunner(target_lm, max_model_len=128, role="target", min_query_tokens=1)
    assert padded.min_query_tokens == 4 and target_lm.dtype == torch.float32
    ids = _ids(20, 3)
    outs = []
    for runner in (padded, plain):
        seq = runner.get_or_create("s", seed=0)
        runner.forward(seq, ids[:12])
        logits = runner.forward(seq, ids[12 : 12 + n], num_logits=num_logits)
        assert seq.length == 12 + n and seq.tokens == ids[: 12 + n]
        nxt = runner.forward(seq, ids[12 + n : 13 + n])  # the next pass sees no trace of the padding
        outs.append((logits, nxt))
    assert outs[0][0].shape == (num_logits, 49152)
    for a, b in zip(outs[0], outs[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("num_logits", [(1, 1, 2), (3, 1, 1), (2, 4, 3)])
def test_runner_batched_pass_scores_only_kept_columns(target_lm, lean, num_logits):
    """A padded batch sends only the columns some row keeps logits for through the LM head (logits_to_keep);
    every row's logits are those of its own one-sequence pass."""
    batched = ModelRunner(target_lm, max_model_len=128, role="target", lean_forward=lean)
    single = ModelRunner(target_lm, max_model_len=128, role="target", lean_forward=lean)
    prompts = [_ids(8 + i, 30 + i) for i in range(3)]
    news = [_ids(w, 40 + i) for i, w in enumerate((3, 4, 3))]
    seqs = [batched.get_or_create(str(i), seed=0) for i in range(3)]
    for seq, p in zip(seqs, prompts):
        batched.forward(seq, p)
    out = batched.forward_batch(seqs, news, list(num_logits))
    for i, (p, new, n) in enumerate(zip(prompts, news, num_logits)):
        ref_seq = single.get_or_create(str(i), seed=0)
        single.forward(ref_seq, p)
        torch.testing.assert_close(out[i], single.forward(ref_seq, new, num_logits=n), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("widths", [(1, 1), (1, 1, 1), (1, 3, 20), (5, 1)])
def test_runner_ragged_pass_matches_single_passes(target_lm, widths, lean):
    """Sequences with different cached lengths and different numbers of new tokens (decode steps, verify
    windows, a prefill chunk) share one pass: logits, blocks and tokens equal one-sequence passes."""
    batched = ModelRunner(target_lm, max_model_len=128, role="target", min_query_tokens=4, lean_forward=lean)
    single = ModelRunner(target_lm, max_model_len=128, role="target", min_query_tokens=1, lean_forward=lean)
    prompts = [_ids(8 + 7 * i, 10 + i) for i in range(len(widths))]
    news = [_ids(w, 20 + i) for i, w in enumerate(widths)]
    seqs = []
    for i, p in enumerate(prompts):
        seq = batched.get_or_create(str(i), seed=0)
        batched.forward(seq, p)
        seqs.append(seq)
    out = batched.forward_batch(seqs, news, list(widths))
    for i, (p, new) in enumerate(zip(prompts, news)):
        ref_seq = single.get_or_create(str(i), seed=0)
        single.forward(ref_seq, p)
        ref = single.forward(ref_seq, new, num_logits=len(new))
        torch.testing.assert_close(out[i], ref, rtol=1e-4, atol=1e-4)
        assert seqs[i].length == len(p) + len(new) and seqs[i].tokens == p + new
        # the next pass sees exactly the real tokens in the cache
        torch.testing.assert_close(batched.forward(seqs[i], [7]), single.forward(ref_seq, [7]), rtol=1e-4, atol=1e-4)
    batched.kv.blocks.check()


def test_loaded_fp32_models_use_skinny_matmuls_and_need_no_padding(target_lm):
    """load_model gives CPU fp32 models SkinnyLinear (cheap 2-8-row products), so runners do not pad;
    a model whose Linear layers are plain keeps the padding in transformers' forward, not in the lean one
    (which picks its products per row count)."""
    import copy

    from specdec.engine.lean_linear import SkinnyLinear

    linears = [m for m in target_lm.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is SkinnyLinear for m in linears)
    assert ModelRunner(target_lm, max_model_len=128, role="target").min_query_tokens == 1
    plain = copy.deepcopy(target_lm.model)
    for m in plain.modules():
        if type(m) is SkinnyLinear:
            m.__class__ = torch.nn.Linear
    assert ModelRunner(replace(target_lm, model=plain), max_model_len=128, role="target",
                       lean_forward=False).min_query_tokens == 4
    assert ModelRunner(replace(target_lm, model=plain), max_model_len=128, role="target").min_query_tokens == 1


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 70])
@pytest.mark.parametrize("out_features", [24, 20000])
def test_skinny_linear_equals_linear(rows, out_features):
    from specdec.engine.lean_linear import SkinnyLinear

    torch.manual_seed(rows)
    ref = torch.nn.Linear(48, out_features, bias=out_features == 24)
    skinny = torch.nn.Linear(48, out_features, bias=out_features == 24)
    skinny.load_state_dict(ref.state_dict())
    skinny.__class__ = SkinnyLinear
    x = torch.randn(1, rows, 48)
    with torch.inference_mode():
        got, want = skinny(x), ref(x)
    assert got.shape == want.shape == (1, rows, out_features) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # with gradients (training), F.linear: bit-identical, and autograd works as usual
    y = skinny(x)
    assert torch.equal(y, ref(x))
    y.sum().backward()
    assert skinny.weight.grad is not None
    with torch.inference_mode():  # bf16 keeps F.linear: bit-identical
        assert torch.equal(skinny.to(torch.bfloat16)(x.bfloat16()), ref.to(torch.bfloat16)(x.bfloat16()))


def test_runner_does_not_pad_past_max_model_len(target_lm):
    runner = ModelRunner(target_lm, max_model_len=14, role="target", min_query_tokens=4)
    seq = runner.get_or_create("s", seed=0)
    runner.forward(seq, _ids(11))
    logits = runner.forward(seq, _ids(3, 1), num_logits=3)  # 11 + 3 = 14: no room for a pad token
    assert logits.shape[0] == 3 and seq.length == 14


def test_runner_max_model_len_and_sequence_cap(target_lm):
    runner = ModelRunner(target_lm, max_model_len=16, role="target", max_sequences=2)
    seq = runner.get_or_create("a", seed=0)
    runner.forward(seq, _ids(16))
    with pytest.raises(InvalidRequestError) as exc:
        runner.forward(seq, [1])
    assert exc.value.param == "max_model_len"
    runner.get_or_create("b", seed=None)
    with pytest.raises(ResourceExhaustedError):
        runner.get_or_create("c", seed=None)
    assert runner.release("a") and not runner.release("a")
    runner.get_or_create("c", seed=None)
    assert "c" in runner.sequences and "a" not in runner.sequences
    with pytest.raises(SequenceNotFoundError) as exc:
        runner.cache.get("a")
    assert "'a'" in str(exc.value)


def test_runner_aligns_vocab(target_lm):
    ids = _ids(5)
    big = ModelRunner(target_lm, max_model_len=32, role="draft", logits_vocab_size=49152 + 7)
    logits = big.forward(big.get_or_create("s", 0), ids)
    assert logits.shape == (1, 49159) and torch.isneginf(logits[0, 49152:]).all()
    assert torch.isfinite(logits[0, :49152]).all()
    small = ModelRunner(target_lm, max_model_len=32, role="draft", logits_vocab_size=49000)
    cut = small.forward(small.get_or_create("s", 0), ids)
    assert cut.shape == (1, 49000)
    torch.testing.assert_close(cut[0], logits[0, :49000])


def test_draft_worker_greedy_proposals_follow_draft_model(draft_lm, hf_greedy):
    worker = DraftWorker(ModelRunner(draft_lm, 128, role="draft", quantization="none"), "greedy")  # as HF computes
    prompt = _ids(6, 3)
    prop = worker.propose("s", prompt, 5, SamplingParams(temperature=1.0, seed=0))
    assert prop.draft_probs is None
    assert prop.draft_token_ids == hf_greedy(draft_lm.model, prompt, 5)
    # the last draft is never fed: the cache holds the prompt + k - 1 drafts
    seq = worker.runner.cache.get("s")
    assert seq.length == len(prompt) + 4 and seq.tokens == prompt + prop.draft_token_ids[:4]
    worker.release("s")
    assert "s" not in worker.runner.sequences


def test_draft_worker_probabilistic_proposals(draft_lm):
    worker = DraftWorker(ModelRunner(draft_lm, 128, role="draft", quantization="none"), "probabilistic")
    prompt = _ids(6, 4)
    params = SamplingParams(temperature=1.0, top_k=5, seed=3)
    prop = worker.propose("s", prompt, 4, params)
    assert prop.draft_probs.shape == (4, 49152)
    torch.testing.assert_close(prop.draft_probs.sum(-1), torch.ones(4))
    assert all((row > 0).sum() <= 5 for row in prop.draft_probs)
    for i, t in enumerate(prop.draft_token_ids):
        assert prop.draft_probs[i, t] > 0
    # the first row is the draft's processed distribution after the prompt
    with torch.inference_mode():
        q0 = process_logits(draft_lm.model(torch.tensor([prompt])).logits[0, -1], params)
    torch.testing.assert_close(prop.draft_probs[0], q0, rtol=1e-4, atol=1e-6)
    # greedy requests never get probabilities, even with the probabilistic method
    again = worker.propose("t", prompt, 3, SamplingParams(temperature=0))
    assert again.draft_probs is None
    # seeded: a fresh worker reproduces the proposal
    other = DraftWorker(ModelRunner(draft_lm, 128, role="draft", quantization="none"), "probabilistic")
    assert other.propose("s", prompt, 4, params).draft_token_ids == prop.draft_token_ids


def test_draft_worker_rejects_unknown_method(draft_lm):
    with pytest.raises(InvalidRequestError) as exc:
        DraftWorker(ModelRunner(draft_lm, 128, role="draft"), "typical")
    assert exc.value.param == "draft_sample_method"


def test_target_worker_verify_rolls_back_rejected_tail(target_lm, hf_greedy):
    worker = TargetWorker(ModelRunner(target_lm, 128, role="target"))
    prompt = _ids(7, 5)
    ref = hf_greedy(target_lm.model, prompt, 6)
    params = SamplingParams(temperature=0)
    wrong = (ref[2] + 1) % 49152
    draft = ref[:2] + [wrong, ref[3]]
    result = worker.verify("s", prompt, Proposal(draft), params)
    assert (result.num_accepted_tokens, result.next_token_id) == (2, ref[2])
    assert result.emitted(draft) == ref[:3]
    seq = worker.runner.cache.get("s")
    assert seq.length == len(prompt) + 2 and seq.tokens == prompt + ref[:2]
    # next round continues from the accepted history
    history = prompt + ref[:3]
    result = worker.verify("s", history, Proposal(ref[3:6]), params)
    assert result.num_accepted_tokens == 3 and result.emitted(ref[3:6])[:3] == ref[3:6]
    # a worker that lost the sequence recomputes it from the history it is sent
    worker.release("s")
    again = worker.verify("s", history, Proposal(ref[3:6]), params)
    assert again == result


def test_sync_repairs_blocks_left_ahead_of_its_tokens(target_lm):
    """A pass that raised half-way leaves blocks reserved (and maybe written) past the tokens; the next sync
    lets them go, and what it feeds overwrites whatever the failed pass wrote."""
    runner = ModelRunner(target_lm, max_model_len=128, role="target")
    ids = _ids(16, 4)
    seq = runner.get_or_create("s", seed=0)
    runner.forward(seq, ids[:10])
    assert runner.cache.reserve([seq], [40]) == [True]  # as if a pass feeding 40 tokens reserved, then failed
    assert len(seq.blocks) == 4 and seq.length == 10
    fed = runner.sync(seq, ids)
    assert fed == ids[10:] and len(seq.blocks) == 1
    logits = runner.forward(seq, fed)
    with torch.inference_mode():
        fresh = target_lm.model(torch.tensor([ids])).logits[0, -1:]
    torch.testing.assert_close(logits, fresh, rtol=1e-4, atol=1e-4)
    runner.release("s")
    runner.kv.blocks.check()
    assert runner.kv.blocks.num_used == 0


def test_a_row_past_max_model_len_fails_alone_in_its_batch(target_lm, draft_lm):
    """Length and id checks run per row before the batched pass: the neighbours still get results,
    equal to their unbatched ones."""
    params = SamplingParams(temperature=0)
    good, long = _ids(10, 6), _ids(60, 7)
    target = TargetWorker(ModelRunner(target_lm, 64, role="target"))
    bad, ok = target.verify_batch([VerifyCall("long", long, Proposal(long[:5]), params),
                                   VerifyCall("good", good, Proposal(good[:3]), params)])
    assert isinstance(bad, InvalidRequestError) and "max_model_len" in str(bad)
    target.release("good")
    assert ok == target.verify("good", good, Proposal(good[:3]), params)
    draft = DraftWorker(ModelRunner(draft_lm, 64, role="draft"))
    bad, ok, bad_ids = draft.propose_batch([ProposeCall("long", long, 6, params), ProposeCall("good", good, 3, params),
                                            ProposeCall("ids", [10**7], 2, params)])
    assert isinstance(bad, InvalidRequestError) and "max_model_len" in str(bad)
    assert isinstance(bad_ids, InvalidRequestError) and "vocabulary" in str(bad_ids)
    draft.release("good")
    assert ok.draft_token_ids == draft.propose("good", good, 3, params).draft_token_ids


def test_target_worker_no_drafts_is_plain_decoding(target_lm, hf_greedy):
    worker = TargetWorker(ModelRunner(target_lm, 128, role="target"))
    prompt = _ids(5, 6)
    ref = hf_greedy(target_lm.model, prompt, 3)
    history = list(prompt)
    for expected in ref:
        r = worker.verify("s", history, Proposal([]), SamplingParams(temperature=0))
        assert r.num_accepted_tokens == 0 and r.next_token_id == expected
        history.append(r.next_token_id)


def test_decode_releases_worker_caches(target_dir, good_draft_dir, spec):
    llm = LLM(str(target_dir), speculative_config=spec(good_draft_dir, 3), dtype="float32")
    llm.generate(PROMPTS, _greedy(8))
    assert not llm._target_worker.runner.sequences and not llm._draft_worker.runner.sequences
    # abandoned stream (client went away): caches released, sequence marked aborted
    ids = llm.get_tokenizer()(PROMPTS[0]).input_ids
    seq = llm.new_sequence(ids, _greedy(20))
    stream = llm.stream(seq)
    next(stream)
    assert llm._target_worker.runner.sequences
    stream.close()
    assert seq.finish_reason == "abort" and 0 < len(seq.output_token_ids) < 20
    assert not llm._target_worker.runner.sequences and not llm._draft_worker.runner.sequences


def test_stream_yields_text_that_concatenates_to_output(target_dir, good_draft_dir, spec):
    llm = LLM(str(target_dir), speculative_config=spec(good_draft_dir, 4), dtype="float32")
    ids = llm.get_tokenizer()(PROMPTS[1]).input_ids
    seq = llm.new_sequence(ids, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    deltas = list(llm.stream(seq))
    assert "".join(deltas) == seq.text == llm.get_tokenizer().decode(seq.output_token_ids, skip_special_tokens=True)
    assert len(deltas) == seq.stats.num_target_passes  # one delta per round


@pytest.mark.parametrize("k", [1, 4, MAX_NUM_SPECULATIVE_TOKENS])
def test_check_num_speculative_tokens_ok(k):
    check_num_speculative_tokens(k)


@pytest.mark.parametrize("k", [0, -1, MAX_NUM_SPECULATIVE_TOKENS + 1, 2.0, "4", True, None])
def test_check_num_speculative_tokens_rejects(k):
    with pytest.raises(InvalidRequestError) as exc:
        check_num_speculative_tokens(k)
    assert exc.value.param == "num_speculative_tokens"


def test_new_sequence_assigns_a_seed(target_dir):
    """Unseeded requests get a seed from the LLM's own RNG, so each worker can derive its generator."""
    llm = LLM(str(target_dir), dtype="float32")
    seq = llm.new_sequence([1, 2, 3], SamplingParams(max_tokens=2))
    assert isinstance(seq, SequenceState) and seq.params.seed is not None and seq.budget == 2
