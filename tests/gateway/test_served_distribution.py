"""The SERVED sampled path is lossless: what the gateway streams follows the target alone, jointly over
two tokens, and the same statistic catches realistic bugs.

Every sample is one ``GenerationService.Generate`` call (``prompt_token_ids``, ``max_tokens=2``,
temperature 1, a seed of its own) through gateway + draft service + target service, all started in this
process on loopback (the ``servers`` fixture, one set per module), CONCURRENCY calls at a time so the
services batch. With ``max_tokens=2`` the gateway drafts k = 1 token, so each request takes exactly one
of the two paths of the acceptance rule, and its stats say which:

* accept:  draft x accepted, then the bonus y ~ p(. | prompt + x), both from one verify pass;
* reject:  recovered x ~ norm(max(p - q, 0)), then a round without a draft samples y ~ p(. | prompt + x).

The pairs (x, y) must follow p(x) * p(y | prompt + x), computed from the target with a plain transformers
forward and the same ``specdec.sampling.process_logits``: a Pearson chi-square (the ``chi2_pvalue``
fixture, which pools rare cells) must keep p >= ALPHA, and both paths must have run.

Pairs and configurations:

* WORD pair (configurations 1 and 2): a WordLevel tokenizer of 200 words; the target is a tiny random
  Llama with its lm_head scaled up (peaky: top-1 ~0.4 after the prompt, so the top joint cells get real
  counts); the draft is the target + noise with a flatter lm_head, so drafts are often rejected.
  1. probabilistic drafting with the draft service's top-N cut of q (``draft_top_n``). The default, 256,
     is larger than this vocabulary and would cut nothing, so the draft service runs with TOP_N = 4, which
     cuts ~46 % of q's mass after the prompt (``test_word_pair_is_as_designed`` checks that it cuts > 30 %).
  2. greedy drafting at temperature 1 (q one-hot). Both gateways share one draft and one target service,
     which samples seeded requests by rejection (``seeded_sampling="rejection"``: every request here has
     a seed, and these configurations and the negative controls are about rejection sampling).
  The coupled rule (the default for seeded requests): probabilistic drafting as in 1, for a second target
  service with the default ``seeded_sampling``; accepts and mismatches both happen, and the pairs must
  follow the same joint.
* TLI pair (configuration 3): a tiny target over Gemma-3's real tokenizer (262,144 ids) and a tiny draft
  over SmolLM2's (49,152 ids), built as in tests/specdec/tli/test_tli_sampling.py: next-token logits after
  the prompt pinned on 8 words for the target, on 5 of them + 3 others for the draft. The draft service
  runs with ``target_tokenizer`` (probabilistic drafting over the intersection; q travels in target ids).
  Requests use top_k = 8 (the reference too), so p has 8 tokens of support at each position and the
  joint reference has at most 64 cells: cheap to compute exactly, so the TLI check is joint, not
  first-token-only. The pair is handed to the services in memory (as ``tiny_tli.llm_over`` hands it to
  ``LLM``) because every load of Gemma's tokenizer costs ~4 s and three services would load it. A TLI
  sample costs ~5x a word-pair sample (top-k, softmax and a multinomial over 262,144 ids per verified
  row), hence N_TLI < N_WORD. Skipped, like the other TLI tests, without the tokenizers' pip packages.

Negative controls: the same test, statistic and threshold on samples from broken variants, monkeypatched
into the library functions the in-process services call (tests/broken_samplers.py):

  (a) q not renormalised after the top-N cut  -> configuration 1, the only one whose q is cut;
  (b) bonus token drawn from q instead of p   -> configuration 1: a greedy draft has no q to draw from
                                                 (its one-hot "q" would just repeat the draft);
  (c) accepted count off by one               -> configuration 2;
  (d) recovered token drawn from p            -> configuration 2.

(c) and (d) are detected in configurations 1 and 3 too (checked once; TLI's run costs too long for CI).
The controls use N_NEGATIVE samples, fewer than the positive runs: the test's power only grows with the
sample size, so a bug caught with N_NEGATIVE samples is caught with N_WORD (checked at N_WORD too:
p < 1e-60 for each). At N_NEGATIVE they give p < 1e-9 over several seed ranges, far below ALPHA.
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
import torch

import specdec.engine.workers
from specdec.sampling import SamplingParams, process_logits
from specdec.v1 import generation_service_pb2_grpc
from specdec.drafting_state import DraftingState
from tests.broken_samplers import (accepted_off_by_one, bonus_from_q, recover_from_p, rowwise,
                                   truncate_top_n_unnormalised)
from tests.services_conftest_helpers import HOST, RPC_TIMEOUT, collect, generate_request

ALPHA = 1e-3  # the real sampler must keep p >= ALPHA; a broken one must fall below it
CONCURRENCY = 16  # Generate calls in flight: the services batch them
N_WORD = 2000  # samples per positive run of the word pair
N_TLI = 800  # samples of the TLI pair (~5x slower per sample)
N_NEGATIVE = 500  # samples per negative control

# -- the word pair -----------------------------------------------------------------------------------
VOCAB = 200
PROMPT_IDS = [1, 10, 20, 30]  # <s> w7 w17 w27
TARGET_HEAD_SCALE = 20.0  # target lm_head x 20: top-1 ~0.4 after the prompt, peaky continuations
DRAFT_NOISE = 0.5  # draft = target + N(0, (0.5 std)^2) on every matrix ...
DRAFT_HEAD = 0.5  # ... with its lm_head halved: flatter than the target
TOP_N = 4  # the draft service's draft_top_n (see the module docstring)
PARAMS = SamplingParams(temperature=1.0)

# -- the TLI pair (target: Gemma-3's tokenizer, draft: SmolLM2's) ------------------------------------------
TLI_PROMPT = "The quick brown fox"
TLI_TOP_K = 8
TLI_PARAMS = SamplingParams(temperature=1.0, top_k=TLI_TOP_K)
TLI_TARGET_LOGITS = {" the": 10.0, " of": 9.5, " and": 9.2, " to": 9.0, " in": 8.5, " is": 8.0, " that": 7.5,
                     " for": 7.0}
# 5 of the target's words, weighted differently, and 3 words p gives 0: accepts AND rejections
TLI_DRAFT_LOGITS = {" of": 14.5, " with": 14.0, " in": 13.5, " the": 13.0, " on": 13.0, " and": 12.5, " to": 12.0,
                    " as": 12.0}


# --------------------------------------------------------------------------------------------------
# sampling through the gateway


@dataclass
class Samples:
    pairs: collections.Counter  # (first token, second token) -> count
    accepted: int  # requests whose draft was accepted (the bonus path)
    rejected: int  # requests whose draft was rejected (the recovery path)
    seconds: float

    @property
    def n(self) -> int:
        return self.accepted + self.rejected

    def describe(self) -> str:
        return f"{self.n} samples in {self.seconds:.1f} s, first draft accepted in {self.accepted / self.n:.1%}"


def sample_pairs(stub, prompt_ids: list[int], n: int, seed: int, top_k: int = 0) -> Samples:
    """``n`` Generate calls (seeds seed .. seed + n - 1), CONCURRENCY at a time; the two emitted tokens of each."""

    def one(i: int):
        req = generate_request(prompt_token_ids=prompt_ids, max_tokens=2, temperature=1.0, seed=seed + i)
        req.sampling_params.top_k = top_k
        out = collect(stub.Generate(req, timeout=RPC_TIMEOUT))
        stats = out.last.stats
        # k = max_tokens - 1 = 1 draft token, in the first round only
        assert len(out.token_ids) == 2 and stats.num_draft_tokens == 1, (out.token_ids, stats)
        return tuple(out.token_ids), stats.num_accepted_tokens

    start = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(one, range(n)))
    accepted = sum(a for _, a in results)
    return Samples(collections.Counter(p for p, _ in results), accepted, n - accepted, time.perf_counter() - start)


def assert_both_paths_ran(s: Samples) -> None:
    assert s.accepted >= 0.05 * s.n and s.rejected >= 0.05 * s.n, (
        f"the accept path ran {s.accepted} times and the reject/recover path {s.rejected} times out of {s.n}")


def gateway_stub(handle, channels: list) -> generation_service_pb2_grpc.GenerationServiceStub:
    channel = grpc.insecure_channel(f"{HOST}:{handle.port}")
    channels.append(channel)
    return generation_service_pb2_grpc.GenerationServiceStub(channel)


# --------------------------------------------------------------------------------------------------
# the word pair


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _word_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.02, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(TARGET_HEAD_SCALE)
    return model


def _word_draft(target):
    from transformers import LlamaForCausalLM

    draft = LlamaForCausalLM(target.config).eval()
    g = torch.Generator().manual_seed(1)
    state = {name: (w + DRAFT_NOISE * w.std() * torch.randn(w.shape, generator=g) if w.dim() >= 2 else w.clone())
             for name, w in target.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"] * DRAFT_HEAD
    draft.load_state_dict(state)
    return draft


@torch.inference_mode()
def _next_token_probs(model, contexts: list[list[int]], params: SamplingParams) -> torch.Tensor:
    """[len(contexts), vocab] processed next-token distributions (one plain forward, no cache)."""
    logits = model(input_ids=torch.tensor(contexts)).logits[:, -1]
    return process_logits(logits, params).double()


@dataclass
class WordPair:
    target_dir: object
    draft_dir: object
    joint: torch.Tensor  # [VOCAB, VOCAB] p(x) p(y | prompt + x)
    p0: torch.Tensor  # target after the prompt
    q0: torch.Tensor  # draft after the prompt (before the top-N cut)


@pytest.fixture(scope="module")
def word_pair(tmp_path_factory) -> WordPair:
    from transformers import LlamaForCausalLM

    tok = _word_tokenizer()
    target = _word_target()
    draft = _word_draft(target)
    dirs = []
    for name, model in (("target", target), ("draft", draft)):
        folder = tmp_path_factory.mktemp(f"word-{name}")
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        dirs.append(folder)
    # the reference: the target as saved, read back by transformers
    ref = LlamaForCausalLM.from_pretrained(dirs[0]).eval()
    p0 = _next_token_probs(ref, [PROMPT_IDS], PARAMS)[0]
    p1 = _next_token_probs(ref, [PROMPT_IDS + [x] for x in range(VOCAB)], PARAMS)  # row x: p(. | prompt + x)
    q0 = _next_token_probs(draft, [PROMPT_IDS], PARAMS)[0]
    return WordPair(dirs[0], dirs[1], p0[:, None] * p1, p0, q0)


@pytest.fixture(scope="module")
def word_stubs(servers, word_pair):
    """{"probabilistic", "greedy", "coupled"} -> a gateway stub. The first two share one target service that
    samples seeded requests by rejection (the rule these tests and their negative controls are about) and
    one draft service; "coupled" drafts probabilistically with the same draft for a target service with the
    default rule, the coupled race."""
    # One compute thread each: the machine's cores are shared by both services and gRPC.
    target = servers.target(word_pair.target_dir, num_threads=1, seeded_sampling="rejection")
    draft = servers.draft(word_pair.draft_dir, num_threads=1, draft_top_n=TOP_N)
    channels: list = []
    stubs = {method: gateway_stub(servers.gateway(target, draft, draft_sample_method=method), channels)
             for method in ("probabilistic", "greedy")}
    coupled = servers.target(word_pair.target_dir, num_threads=1)
    stubs["coupled"] = gateway_stub(servers.gateway(coupled, draft, draft_sample_method="probabilistic"), channels)
    yield stubs
    for channel in channels:
        channel.close()


def word_pvalue(chi2_pvalue, pair: WordPair, s: Samples) -> float:
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for (x, y), c in s.pairs.items():
        counts[x, y] += c
    return chi2_pvalue(counts, pair.joint)


def test_word_pair_is_as_designed(word_pair):
    """The properties the tests rely on (so a change of random init cannot weaken them silently)."""
    p0, q0 = word_pair.p0, word_pair.q0
    kept = float(q0.topk(TOP_N).values.sum())
    assert kept < 0.7, f"draft_top_n={TOP_N} keeps {kept:.0%} of q: the cut must remove real mass"
    assert 0.2 < float(p0.max()) < 0.8 and 0.1 < float(p0[q0.argmax()]) < 0.8, "greedy drafts must be rejected often"
    top = word_pair.joint.flatten().sort(descending=True).values
    assert float(top[top * N_NEGATIVE >= 5].sum()) > 0.4, "the joint must be peaky enough for counts"


@pytest.mark.heavy
@pytest.mark.parametrize("method", ["probabilistic", "greedy", "coupled"])
def test_word_pair_joint_follows_target(word_stubs, word_pair, chi2_pvalue, method):
    seed = {"probabilistic": 10**6, "greedy": 2 * 10**6, "coupled": 4 * 10**6}[method]
    s = sample_pairs(word_stubs[method], PROMPT_IDS, N_WORD, seed=seed)
    assert_both_paths_ran(s)
    pv = word_pvalue(chi2_pvalue, word_pair, s)
    print(f"\n{method}: chi-square p={pv:.3g}; {s.describe()}")
    assert pv >= ALPHA, f"{method}: (x, y) do not follow the target (chi-square p={pv:.2e}); {s.describe()}"


NEGATIVE_CONTROLS = [
    pytest.param("truncate_top_n", truncate_top_n_unnormalised, "probabilistic", id="a-q-not-renormalised-after-top-n"),
    pytest.param("accept_batch", rowwise(bonus_from_q), "probabilistic", id="b-bonus-from-q"),
    pytest.param("accept_batch", rowwise(accepted_off_by_one), "greedy", id="c-accepted-off-by-one"),
    pytest.param("accept_batch", rowwise(recover_from_p), "greedy", id="d-recovered-from-p"),
]


@pytest.mark.heavy
@pytest.mark.parametrize("attr, broken, method", NEGATIVE_CONTROLS)
def test_negative_control_is_detected(word_stubs, word_pair, chi2_pvalue, monkeypatch, attr, broken, method):
    """The same statistic, on samples from a broken variant running inside the services, must reject."""
    monkeypatch.setattr(specdec.engine.workers, attr, broken)
    s = sample_pairs(word_stubs[method], PROMPT_IDS, N_NEGATIVE, seed=5 * 10**6)
    pv = word_pvalue(chi2_pvalue, word_pair, s)
    print(f"\n{broken.__name__} ({method}): chi-square p={pv:.3g}; {s.describe()}")
    assert pv < ALPHA, f"{broken.__name__}: a broken variant passed the chi-square test (p={pv:.2e}); {s.describe()}"


# --------------------------------------------------------------------------------------------------
# the TLI pair


@dataclass
class TLIPair:
    models: dict  # name -> LoadedModel
    tokenizers: dict  # name -> tokenizer
    prompt_ids: list[int]
    joint: dict  # (x, y) -> p(x) p(y | prompt + x), over the support


@pytest.fixture(scope="module")
def tli_pair() -> TLIPair:
    from specdec.tli.adapter import TLIAdapter
    from tests.specdec.tli.tiny_tli import last_logits, loaded_model, pin_next_token_logits, real_tokenizers, tiny_llama

    tt, dt = real_tokenizers()  # skips without the pip packages

    def single_id(tok, word: str) -> int:
        ids = tok(word, add_special_tokens=False).input_ids
        assert len(ids) == 1, f"{word!r} is not one token: {ids}"
        return ids[0]

    target = tiny_llama(len(tt), seed=0, bos=tt.bos_token_id, eos=tt.eos_token_id, pad=tt.pad_token_id)
    draft = tiny_llama(len(dt), seed=1, bos=dt.bos_token_id, eos=dt.eos_token_id, pad=dt.pad_token_id)
    prompt_ids = list(tt(TLI_PROMPT).input_ids)
    draft_prompt_ids = TLIAdapter(dt, tt, len(tt)).draft_history(DraftingState(), prompt_ids)  # what the draft service reads
    pin_next_token_logits(target, prompt_ids, {single_id(tt, w): v for w, v in TLI_TARGET_LOGITS.items()})
    pin_next_token_logits(draft, draft_prompt_ids, {single_id(dt, w): v for w, v in TLI_DRAFT_LOGITS.items()})

    p0 = process_logits(last_logits(target, prompt_ids), TLI_PARAMS).double()
    joint = {}
    for x in p0.nonzero().flatten().tolist():
        p1 = process_logits(last_logits(target, prompt_ids + [x]), TLI_PARAMS).double()
        for y in p1.nonzero().flatten().tolist():
            joint[(x, y)] = float(p0[x] * p1[y])
    assert len(p0.nonzero()) == TLI_TOP_K and abs(sum(joint.values()) - 1) < 1e-6
    models = {"tiny-gemma-target": loaded_model("tiny-gemma-target", target, tt),
              "tiny-smollm2-draft": loaded_model("tiny-smollm2-draft", draft, dt)}
    return TLIPair(models, {"tiny-gemma-target": tt, "tiny-smollm2-draft": dt}, prompt_ids, joint)


@pytest.fixture(scope="module")
def tli_stub(servers, tli_pair):
    import gateway.generation
    import specdec.model_files
    import specdec.serving.backend

    def load_tokenizer(name, revision=None):
        return tli_pair.tokenizers[name]

    with pytest.MonkeyPatch.context() as mp:  # only while the services load
        mp.setattr(specdec.serving.backend, "load_model", lambda name, **kw: tli_pair.models[name])
        mp.setattr(specdec.model_files, "load_tokenizer", load_tokenizer)
        mp.setattr(gateway.generation, "load_tokenizer", load_tokenizer)
        target = servers.target("tiny-gemma-target", num_threads=1, seeded_sampling="rejection")
        draft = servers.draft("tiny-smollm2-draft", num_threads=1, target_tokenizer="tiny-gemma-target")
        gw = servers.gateway(target, draft, draft_sample_method="probabilistic", use_heterogeneous_vocab=True)
    from specdec.tli.adapter import TLIAdapter

    assert isinstance(draft.backend.tli, TLIAdapter)
    channels: list = []
    yield gateway_stub(gw, channels)
    for channel in channels:
        channel.close()


@pytest.mark.heavy
def test_tli_joint_follows_target(tli_stub, tli_pair, chi2_pvalue):
    s = sample_pairs(tli_stub, tli_pair.prompt_ids, N_TLI, seed=3 * 10**6, top_k=TLI_TOP_K)
    assert_both_paths_ran(s)
    cells = sorted(tli_pair.joint)
    outside = sum(c for pair, c in s.pairs.items() if pair not in tli_pair.joint)
    observed = [s.pairs.get(cell, 0) for cell in cells] + [outside]
    expected = [tli_pair.joint[cell] for cell in cells] + [0.0]  # a pair outside p's support gives p = 0
    pv = chi2_pvalue(observed, expected)
    print(f"\nTLI: chi-square p={pv:.3g} over {len(cells)} cells; {s.describe()}")
    assert pv >= ALPHA, f"TLI: (x, y) do not follow the target (chi-square p={pv:.2e}); {s.describe()}"
