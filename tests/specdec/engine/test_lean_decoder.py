"""specdec.engine.lean_decoder / lean_gemma3: the lean forward (every role's default) against transformers', and draft
vocabularies. Tiny random-weight models here; the real SmolLM2-135M and Gemma-3-270M at the end (slow)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from specdec.engine.lean_decoder import LeanDecoder

from specdec.engine.lean_forward import lean_decoder, unsupported_reason
from specdec.engine.lean_gemma3 import LeanGemma3Decoder
from specdec.llm import LLM
from specdec.engine.models import DRAFT_VOCAB_FILE, LoadedModel, load_draft_vocab, load_model
from specdec.engine.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.calls import ProposeCall
from specdec.engine.workers import DraftWorker
from tests.conftest import spec_config
from tests.requirements import require_package

VOCAB = 1000
WINDOW = 8  # the tiny Gemma-3 models' sliding window: _passes' sequences run to 60 tokens
GEMMA3_LAYERS = dict(num_hidden_layers=3, head_dim=16, sliding_window=WINDOW,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def _tiny(arch: str, seed: int = 0, **over):
    """A tiny random model of ``arch`` (logits scaled up so argmaxes are far from ties; norm weights random, so
    Gemma's (1 + w) and Llama's w differ from 1)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if arch == "gemma3":
        common.update(GEMMA3_LAYERS, tie_word_embeddings=False)
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
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
        if model.lm_head.weight is not model.model.embed_tokens.weight:
            model.lm_head.weight.mul_(8.0)
    return model


def _lm(model, dtype=torch.float32, draft_vocab=None) -> LoadedModel:
    model = model.to(dtype)
    return LoadedModel(name="tiny", model=model, tokenizer=None, source="tiny", dtype=dtype,
                       device=torch.device("cpu"), draft_vocab=draft_vocab)


def _ids(n, seed=0):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _passes(runner: ModelRunner) -> list[torch.Tensor]:
    """A prefill, a multi-token pass, a one-token pass and padded batches of two sequences."""
    ids = _ids(60, 1)
    a, b = runner.get_or_create("a", 0), runner.get_or_create("b", 0)
    out = [runner.forward(a, ids[:30], 2), runner.forward(a, ids[30:34], 4), runner.forward(a, ids[34:35])]
    runner.forward(b, ids[40:50])
    out += runner.forward_batch([a, b], [ids[35:37], ids[50:53]], [2, 3])
    out.append(runner.forward(a, ids[37:38]))  # after the batch: the scattered cache is intact
    out += runner.forward_batch([a, b], [ids[38:40], ids[53:56]], [1, 2])  # only columns 1-2 reach the LM head
    return out


LLAMA_CASES = [
    ("llama", {}),
    ("llama", {"attention_bias": True, "tie_word_embeddings": True}),
    ("qwen2", {}),  # q/k/v biases
    ("mistral", {"num_key_value_heads": 4}),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 32}}),
]
GEMMA3_CASES = [
    ("gemma3", {}),  # sliding (window 8) and global layers, separate rope bases, 60-token sequences
    ("gemma3", {"final_logit_softcapping": 3.0, "query_pre_attn_scalar": 24, "attention_bias": True,
                "num_key_value_heads": 1, "tie_word_embeddings": True}),
    ("gemma3", {"layer_types": ["full_attention"] * 3, "rope_local_base_freq": 100.0}),
    ("gemma3", {"layer_types": ["sliding_attention"] * 3, "sliding_window": 3}),
]


@pytest.mark.parametrize("arch,over", LLAMA_CASES + GEMMA3_CASES)
@pytest.mark.parametrize("role", ["draft", "target"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_forward_equals_transformers(arch, over, role, dtype):
    """A prefill, a multi-token pass, a one-token pass and a padded batch (lean vs transformers, same model)."""
    lm = _lm(_tiny(arch, **over), dtype)
    hf = ModelRunner(lm, 256, role=role, lean_forward=False)
    lean = ModelRunner(lm, 256, role=role, lean_forward=True, quantization="none")  # a draft's default is int8
    assert hf.net is lm.model and isinstance(lean.net, LeanGemma3Decoder if arch == "gemma3" else LeanDecoder)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.15)
    for x, y in zip(_passes(hf), _passes(lean)):
        torch.testing.assert_close(y, x, **tol)
        if dtype == torch.float32:
            assert torch.equal(x.argmax(-1), y.argmax(-1))


def test_gemma3_sliding_layers_see_only_their_window():
    """The windowed logits are transformers' and differ from the same lean forward without the window (the
    comparisons above would not notice a window that is never applied otherwise)."""
    lm = _lm(_tiny("gemma3"))
    ref = _passes(ModelRunner(lm, 256, role="target", lean_forward=False))
    lean = ModelRunner(lm, 256, role="target")
    assert lean.net.window == WINDOW and {layer.kind for layer in lean.net.layers} == {"sliding_attention",
                                                                                       "full_attention"}
    for x, y in zip(ref, _passes(lean)):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)
    unwindowed = ModelRunner(lm, 256, role="target")
    unwindowed.net.window = None
    unwindowed._windows = unwindowed.net.windows()  # the runner reads the windows once
    far = [(x - y).abs().max() for x, y in zip(ref, _passes(unwindowed))]
    assert max(far) > 0.1, far


@pytest.mark.parametrize("use_onednn", [True, False])
def test_lean_forward_without_onednn_matmuls(use_onednn):
    """The products' other formulations (F.linear / skinny where oneDNN is unavailable) compute the same."""
    for arch in ("llama", "gemma3"):
        lm = _lm(_tiny(arch))
        ref = _passes(ModelRunner(lm, 256, role="target", lean_forward=False))
        runner = ModelRunner(lm, 256, role="target")
        runner.net = lean_decoder(lm.model, use_onednn=use_onednn)
        assert (runner.net.lm_head.packed is not None) == use_onednn
        for x, y in zip(ref, _passes(runner)):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)


def test_lean_forward_with_padded_short_queries():
    """min_query_tokens pads a pass with copies of its last token; the lean pass drops them like transformers'."""
    lm = _lm(_tiny("llama"))
    out = [_passes(ModelRunner(lm, 256, role="draft", lean_forward=lean, min_query_tokens=4,
                                   quantization="none")) for lean in (False, True)]
    for x, y in zip(*out):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)


def test_every_role_uses_the_lean_forward_by_default():
    for arch, cls in (("llama", LeanDecoder), ("gemma3", LeanGemma3Decoder)):
        lm = _lm(_tiny(arch))
        for role in ("draft", "target"):
            runner = ModelRunner(lm, 64, role=role)
            assert type(runner.net) is cls and runner.min_query_tokens == 1, (arch, role)
        assert ModelRunner(lm, 64, role="target", lean_forward=False).net is lm.model


def test_unsupported_models_keep_the_transformers_forward_and_say_why(caplog):
    capped = _tiny("gemma3", attn_logit_softcapping=50.0)
    assert "attn_logit_softcapping" in unsupported_reason(capped)
    assert lean_decoder(capped) is None
    with pytest.raises(ValueError, match="cannot run this model"):
        LeanGemma3Decoder(capped)
    with pytest.raises(ValueError, match="cannot run this model"):
        LeanDecoder(_tiny("gemma3"))  # the Llama family's class refuses Gemma-3 (lean_decoder picks the right one)
    with caplog.at_level(logging.INFO, logger="specdec.engine.network"):
        assert ModelRunner(_lm(capped), 64, role="target").net is capped
    assert "keeping transformers' forward" in caplog.text and "attn_logit_softcapping" in caplog.text
    windowed = _tiny("mistral", sliding_window=16)
    assert unsupported_reason(windowed) == "sliding-window attention"
    assert "gelu_pytorch_tanh" in unsupported_reason(_tiny("gemma3", hidden_activation="gelu"))


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


# --------------------------------------------------------------------------------------------------
# the real models (slow): SmolLM2-135M (Llama) and Gemma-3-270M (sliding window 512)


def _real_passes(runner: ModelRunner, ids: list[int]) -> list[torch.Tensor]:
    """_passes on a real model: a 600-token prefill (past Gemma-3's 512-token window), a 5-token pass (a
    verification), one token, a padded batch of two sequences, and one token after it."""
    a, b = runner.get_or_create("a", 0), runner.get_or_create("b", 0)
    out = [runner.forward(a, ids[:600], 3), runner.forward(a, ids[600:605], 5), runner.forward(a, ids[605:606])]
    runner.forward(b, ids[300:340])
    out += runner.forward_batch([a, b], [ids[606:608], ids[340:343]], [2, 3])
    out.append(runner.forward(a, ids[608:609]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma-3-270m"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_models_lean_logits_equal_transformers(name, dtype):
    from tests.specdec.tli.tiny_tli import require_packages

    require_packages(name)
    lm = load_model(name, dtype=dtype)
    ids = lm.tokenizer("The history of the Roman Empire spans many centuries, and its legacy " * 60).input_ids[:620]
    assert len(ids) == 620
    lean = ModelRunner(lm, 4096, role="target")
    assert type(lean.net) is (LeanGemma3Decoder if name == "gemma-3-270m" else LeanDecoder)
    ref = _real_passes(ModelRunner(lm, 4096, role="target", lean_forward=False), ids)
    # measured: fp32 within 1.3e-4 of logits up to ~37; bf16 within 0.41 (2 units in the last place) on AMD EPYC
    # (avx512_bf16), 0.61 on Intel Xeon with AMX (oneDNN's AMX tiles sum in another order), 1.09 at 1 of 786k
    # Gemma logits on AMD EPYC with avx2 only (no bf16 units; the CPU attention kernel sums 8 lanes there): a few
    # units of bf16 noise, amplified through 18 bf16 layers
    tol = dict(rtol=1e-4, atol=1e-3) if dtype == "float32" else dict(rtol=0.02, atol=1.5)
    for x, y in zip(ref, _real_passes(lean, ids)):
        torch.testing.assert_close(y, x, **tol)
        if dtype == "float32":
            assert torch.equal(x.argmax(-1), y.argmax(-1))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma-3-270m"])
def test_real_models_greedy_decoding_equals_transformers(name, cached_model_loading):
    """The target alone, greedy, fp32: the lean forward (default) gives transformers' tokens."""
    from tests.specdec.tli.tiny_tli import require_packages

    require_packages(name)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
    lean, hf = LLM(name, dtype="float32"), LLM(name, dtype="float32", lean_forward=False)
    assert lean._target_worker.runner.net is not lean.target.model
    assert hf._target_worker.runner.net is hf.target.model
    for a, b in zip(lean.generate(prompts, params), hf.generate(prompts, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
