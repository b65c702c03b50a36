"""specdec.lean_decoder: the lean Llama-family forward (drafts' default) and draft vocabularies."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.runner import ModelRunner
from specdec.workers import DraftWorker, ProposeCall
from specdec.lean_decoder import LeanDecoder, lean_decoder, unsupported_reason
from specdec.llm import LLM
from specdec.models import DRAFT_VOCAB_FILE, LoadedModel, load_draft_vocab, load_model
from specdec.sampling import SamplingParams

from tests.conftest import spec_config

VOCAB = 1000


def _tiny(arch: str, seed: int = 0, **over):
    """A tiny random model of ``arch`` (logits scaled up so argmaxes are far from ties)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    common.update(over)
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[arch]
    if arch == "mistral":
        common.setdefault("sliding_window", None)
    model = model_cls(cfg_cls(**common)).eval()
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
    return model


def _lm(model, dtype=torch.float32, draft_vocab=None) -> LoadedModel:
    model = model.to(dtype)
    return LoadedModel(name="tiny", model=model, tokenizer=None, source="tiny", dtype=dtype,
                       device=torch.device("cpu"), draft_vocab=draft_vocab)


def _ids(n, seed=0):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _passes(runner: ModelRunner) -> list[torch.Tensor]:
    """A prefill, a multi-token pass, a one-token pass and a padded batch of two sequences."""
    ids = _ids(60, 1)
    a, b = runner.get_or_create("a", 0), runner.get_or_create("b", 0)
    out = [runner.forward(a, ids[:30], 2), runner.forward(a, ids[30:34], 4), runner.forward(a, ids[34:35])]
    runner.forward(b, ids[40:50])
    out += runner.forward_batch([a, b], [ids[35:37], ids[50:53]], [2, 3])
    out.append(runner.forward(a, ids[37:38]))  # after the batch: the scattered cache is intact
    return out


@pytest.mark.parametrize("arch,over", [
    ("llama", {}),
    ("llama", {"attention_bias": True, "tie_word_embeddings": True}),
    ("qwen2", {}),  # q/k/v biases
    ("mistral", {"num_key_value_heads": 4}),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 32}}),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_forward_equals_transformers(arch, over, dtype):
    lm = _lm(_tiny(arch, **over), dtype)
    hf = ModelRunner(lm, 256, role="draft", lean_forward=False)
    lean = ModelRunner(lm, 256, role="draft", lean_forward=True)
    assert hf.net is lm.model and isinstance(lean.net, LeanDecoder)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.15)
    for x, y in zip(_passes(hf), _passes(lean)):
        torch.testing.assert_close(y, x, **tol)
        if dtype == torch.float32:
            assert torch.equal(x.argmax(-1), y.argmax(-1))


def test_lean_forward_with_padded_short_queries():
    """min_query_tokens pads a pass with copies of its last token; the lean pass drops them like transformers'."""
    lm = _lm(_tiny("llama"))
    out = [_passes(ModelRunner(lm, 256, role="draft", lean_forward=lean, min_query_tokens=4)) for lean in (False, True)]
    for x, y in zip(*out):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)


def test_drafts_use_the_lean_forward_by_default_targets_do_not():
    lm = _lm(_tiny("llama"))
    assert isinstance(ModelRunner(lm, 64, role="draft").net, LeanDecoder)
    assert ModelRunner(lm, 64, role="target").net is lm.model


def test_unsupported_models_keep_the_transformers_forward():
    gemma = _tiny("gemma3", head_dim=16)
    assert "model_type" in unsupported_reason(gemma)
    assert lean_decoder(gemma) is None
    with pytest.raises(ValueError, match="cannot run this model"):
        LeanDecoder(gemma)
    assert ModelRunner(_lm(gemma), 64, role="draft").net is gemma
    windowed = _tiny("mistral", sliding_window=16)
    assert unsupported_reason(windowed) == "sliding-window attention"


def test_lean_needs_a_cache():
    dec = LeanDecoder(_tiny("llama"))
    with pytest.raises(ValueError, match="needs a cache"):
        dec(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]))


# --------------------------------------------------------------------------------------------------
# draft vocabularies


@pytest.mark.parametrize("lean", [True, False])
def test_draft_vocab_restricts_draft_logits_only(lean):
    model = _tiny("llama")
    subset = torch.tensor(sorted(set(_ids(200, 7))))
    lm = _lm(model, draft_vocab=subset)
    draft = ModelRunner(lm, 256, role="draft", lean_forward=lean)
    full = ModelRunner(_lm(model), 256, role="draft", lean_forward=lean)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[subset] = False
    for x, y in zip(_passes(full), _passes(draft)):
        assert torch.isinf(y[:, outside]).all() and (y[:, outside] < 0).all()
        torch.testing.assert_close(y[:, subset], x[:, subset], rtol=1e-4, atol=1e-4)
    # as a target the same model is never restricted
    assert not torch.isinf(_passes(ModelRunner(lm, 256, role="target"))[0]).any()


def test_draft_worker_proposes_only_draft_vocab_ids():
    subset = torch.tensor(sorted(set(_ids(50, 9))))
    worker = DraftWorker(ModelRunner(_lm(_tiny("llama"), draft_vocab=subset), 256, role="draft"),
                         draft_sample_method="probabilistic")
    for method in ("greedy", "probabilistic"):
        res = worker.propose_batch([ProposeCall("s" + method, _ids(12, 3), 6, SamplingParams(temperature=1.0, seed=1),
                                                draft_sample_method=method)])[0]
        assert len(res.draft_token_ids) == 6 and set(res.draft_token_ids) <= set(subset.tolist())
        if method == "probabilistic":  # q: zero outside the draft vocabulary, a distribution inside
            outside = torch.ones(res.draft_probs.shape[-1], dtype=torch.bool)
            outside[subset] = False
            assert float(res.draft_probs[:, outside].abs().sum()) == 0.0
            torch.testing.assert_close(res.draft_probs.sum(-1), torch.ones(6))
        else:
            assert res.draft_probs is None


def test_load_draft_vocab(tmp_path):
    assert load_draft_vocab(tmp_path, 100) is None
    (tmp_path / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": [5, 3, 3, 99]}))
    assert load_draft_vocab(tmp_path, 100).tolist() == [3, 5, 99]
    for bad in ({"token_ids": [100]}, {"token_ids": []}, {"token_ids": [-1]}, {"ids": [1]}, {"token_ids": ["a"]}):
        (tmp_path / DRAFT_VOCAB_FILE).write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=DRAFT_VOCAB_FILE):
            load_draft_vocab(tmp_path, 100)


@pytest.fixture(scope="module")
def vocab_draft_dir(good_draft_dir, target_greedy_ref, tmp_path_factory):
    """The good draft with a draft vocabulary that holds only some of the target's greedy tokens."""
    import shutil

    folder = tmp_path_factory.mktemp("vocab-draft") / "draft"
    shutil.copytree(good_draft_dir, folder)
    greedy = sorted({t for _, out in target_greedy_ref.values() for t in out})
    keep = greedy[::2] + list(range(0, 49152, 7))
    (folder / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": keep}))
    return folder


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_lossless_with_a_draft_vocab(k, target_dir, vocab_draft_dir, target_greedy_ref, tokenizer):
    """A draft restricted to a vocabulary that misses half of the target's tokens: proposals of the missing
    ones are impossible, so acceptance drops, but the output is the target's own."""
    assert load_model(str(vocab_draft_dir)).draft_vocab is not None
    llm = LLM(str(target_dir), speculative_config=spec_config(vocab_draft_dir, k), dtype="float32")
    for prompt, (ids, ref) in target_greedy_ref.items():
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=len(ref), ignore_eos=True))[0].outputs[0]
        assert list(out.token_ids) == ref
