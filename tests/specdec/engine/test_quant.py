"""Quantized execution (``--quantization int8``): the W8A8 product, SmoothQuant, the cached plan, the runner's
defaults by role, and lossless speculation with an int8 draft or an int8 target."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from specdec.config import SpeculativeConfig
from specdec.engine import quant_calibration, quant_plan
from specdec.engine.lean_forward import lean_decoder
from specdec.engine.models import load_model
from specdec.engine.quant import QuantLinear, quantization_unavailable, quantize_rows, quantize_weight
from specdec.engine.quant_plan import QuantPlan, smoothing
from specdec.engine.quant_calibration import build_plan, save_plan
from specdec.engine.runner import ModelRunner
from specdec.errors import ConfigError
from specdec.llm import LLM
from specdec.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("cached_model_loading")


def _rel_err(y, ref):
    return float((y - ref).norm() / ref.norm())


def test_int8_product_is_close_to_the_float_product():
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(96, 64, generator=g), torch.randn(96, generator=g), torch.randn(5, 64, generator=g)
    lin = QuantLinear(w, b)
    assert lin.q.dtype == torch.int8 and lin.q.shape == (96, 64) and lin.out_features == 96
    assert _rel_err(lin(x), F.linear(x, w, b)) < 0.02
    assert lin(x.bfloat16()).dtype == torch.bfloat16
    assert lin(x.view(1, 5, 64)).shape == (1, 5, 96)


def test_weight_and_rows_are_quantized_per_channel_and_per_token():
    w = torch.tensor([[1.0, -2.0, 0.5], [100.0, 50.0, -25.0]])
    q, scale = quantize_weight(w)
    assert q.tolist() == [[64, -127, 32], [127, 64, -32]]  # each row its own scale: max |w| -> 127
    torch.testing.assert_close(scale, torch.tensor([2 / 127, 100 / 127]))
    xq, xs = quantize_rows(torch.tensor([[0.0, 3.0], [-1000.0, 10.0]]))
    assert xq.tolist() == [[0, 127], [-127, 1]]
    torch.testing.assert_close(xs.view(-1), torch.tensor([3 / 127, 1000 / 127]))


def test_a_row_is_the_same_bits_alone_and_in_any_batch():
    """Exact int32 sums and per-row scales: no fixed tiles needed for batch invariance."""
    g = torch.Generator().manual_seed(1)
    lin = QuantLinear(torch.randn(200, 96, generator=g))
    x = torch.randn(33, 96, generator=g)
    whole = lin(x)
    for i in (0, 7, 32):
        assert torch.equal(lin(x[i:i + 1]), whole[i:i + 1])
    assert torch.equal(lin(x[3:20]), whole[3:20])


def test_smoothing_tames_an_outlier_channel():
    """Activations with one channel 60x the others: per-token int8 loses the small channels; SmoothQuant's
    s = sqrt(max|X_j| / max|W_j|) moves the outlier into the weight and the error drops."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(128, 64, generator=g) * 0.05
    x = torch.randn(16, 64, generator=g)
    x[:, 5] *= 60
    ref = F.linear(x, w)
    s = smoothing({"p": x.abs().amax(0)}, {"p": w})["p"]
    naive, smooth = _rel_err(QuantLinear(w)(x), ref), _rel_err(QuantLinear(w, smooth=s)(x), ref)
    assert smooth < naive / 2, (naive, smooth)
    # the smoothed product is the same function: exact in floats
    torch.testing.assert_close(F.linear(x / s, w * s), ref, rtol=1e-4, atol=1e-4)


def test_fp8_is_cuda_only_and_unknown_modes_are_named():
    assert "CUDA" in quantization_unavailable("fp8", "cpu")
    assert quantization_unavailable("int8", "cpu") is None
    assert "none" in quantization_unavailable("int4", "cpu")
    with pytest.raises(ConfigError, match="quantization must be one of"):
        SpeculativeConfig.from_any({"model": "d", "quantization": "int4"})


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(str(target_dir), dtype="float32")


def test_int8_decoder_tracks_the_float_decoder(target):
    plan, _ = build_plan(target, "int8", use_cache=False)
    assert plan.smooth and set(plan.smooth) == {f"{i}.{p}" for i in range(3) for p in quant_plan.PRODUCTS}
    q, f = lean_decoder(target.model, quant=plan), lean_decoder(target.model)
    assert isinstance(q.layers[0].qkv, QuantLinear) and isinstance(q.lm_head, QuantLinear) == plan.quantize_head
    from specdec.engine.kv_cache import SequenceKVCache

    ids = torch.randint(0, 49152, (1, 40), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(40)[None]
    lq = q(ids, pos, cache=SequenceKVCache(3, 64)).logits
    lf = f(ids, pos, cache=SequenceKVCache(3, 64)).logits
    assert _rel_err(lq, lf) < 0.1
    assert (lq.argmax(-1) == lf.argmax(-1)).float().mean() > 0.8


def test_the_plan_is_cached_and_read_back_to_the_same_bits(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    plan, path = build_plan(target, "int8")
    assert path is not None and not path.exists()
    first = lean_decoder(target.model, quant=plan)
    save_plan(plan, path)
    assert path.is_file() and str(tmp_path) in str(path)
    again, none = build_plan(target, "int8")
    assert none is None and set(again.cached) == set(plan.built)
    second = lean_decoder(target.model, quant=again)
    for a, b in ((first.layers[1].down, second.layers[1].down), (first.layers[0].qkv, second.layers[0].qkv)):
        xx = torch.randn(3, a.in_features)
        assert torch.equal(a(xx), b(xx))
    # another mode, or the head quantized, is another file
    assert quant_calibration.cache_path(target.source, target.dtype, "int8", None, ((0.5, False),), False) != path
    path.write_bytes(b"not safetensors")
    broken, rewrite = build_plan(target, "int8")
    assert rewrite == path and broken.rise is not None  # an unreadable cache is recalibrated, then overwritten


def test_calibration_keeps_the_first_setting_within_the_perplexity_budget(target, monkeypatch, caplog):
    plan, _ = build_plan(target, "int8", use_cache=False)  # a target: evaluated on the calibration text
    assert (plan.alpha, plan.quantize_head) == quant_plan.CANDIDATES[0] and plan.rise <= quant_plan.PERPLEXITY_BUDGET
    monkeypatch.setattr(quant_calibration, "PERPLEXITY_BUDGET", -1.0)  # nothing is good enough: the closest, with a warning
    with caplog.at_level(logging.WARNING):
        worst, _ = build_plan(target, "int8", use_cache=False)
    assert "lossy for this model" in caplog.text
    assert (worst.alpha, worst.quantize_head) in quant_plan.CANDIDATES and worst.cached
    # a draft restricted to a draft vocabulary is not evaluated: the first setting, no perplexity
    draft, _ = build_plan(target, "int8", vocab_subset=torch.arange(100), use_cache=False)
    assert draft.rise is None and (draft.alpha, draft.quantize_head) == quant_plan.CANDIDATES[0]


def test_from_tensors_round_trip():
    plan = QuantPlan()
    plan.linear("0.qkv", torch.randn(8, 4), None)
    plan.smooth["0.o"] = torch.ones(4)
    plan.linear("0.o", torch.randn(4, 4), None)
    back = QuantPlan.from_tensors("int8", plan.tensors())
    assert set(back.cached) == {"0.qkv", "0.o"} and set(back.smooth) == {"0.o"} and not back.quantize_head


def test_runner_defaults_by_role(target, caplog):
    assert ModelRunner(target, 64, role="target").quantization == "none"
    draft = ModelRunner(target, 64, role="draft")
    assert draft.quantization == "int8" and isinstance(draft.net.layers[0].gate_up, QuantLinear)
    with caplog.at_level(logging.INFO):
        assert ModelRunner(target, 64, role="draft", lean_forward=False).quantization == "none"
    assert "running unquantized" in caplog.text
    with pytest.raises(ConfigError, match="lean forward is off"):
        ModelRunner(target, 64, role="target", lean_forward=False, quantization="int8")
    with pytest.raises(ConfigError, match="CUDA"):
        ModelRunner(target, 64, role="target", quantization="fp8")


def _greedy(n=24):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


PROMPTS = ["The history of the harbour town", "def parse(items):\n    return"]


def test_int8_draft_is_lossless(target_dir, good_draft_dir, spec):
    """The default int8 draft changes acceptance, never the output."""
    alone = LLM(str(target_dir), dtype="float32").generate(PROMPTS, _greedy())
    llm = LLM(str(target_dir), dtype="float32", speculative_config=spec(good_draft_dir, 3))
    assert llm._draft_worker.runner.quantization == "int8"
    outs = llm.generate(PROMPTS, _greedy())
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    assert sum(o.spec_decode_stats.num_accepted_tokens for o in outs) > 0


def test_int8_target_speculation_equals_the_int8_target_alone(target_dir, good_draft_dir, spec):
    """Exactness is relative to the target as served: an int8 target decoding alone."""
    alone = LLM(str(target_dir), dtype="float32", quantization="int8").generate(PROMPTS, _greedy())
    llm = LLM(str(target_dir), dtype="float32", quantization="int8",
              speculative_config=spec(good_draft_dir, 4, quantization="none"))
    outs = llm.generate(PROMPTS, _greedy())
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    assert sum(o.spec_decode_stats.num_accepted_tokens for o in outs) > 0


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_cuda_products(kind):
    """On the GPU: ``torch._int_mm`` (rows padded to cuBLASLt's shapes) and fp8 ``torch._scaled_mm`` with
    row-wise scales; close to the float product, and a row's bits do not depend on the batch."""
    if kind == "fp8" and quantization_unavailable("fp8", "cuda"):
        pytest.skip(quantization_unavailable("fp8", "cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1024, 576, device="cuda", generator=g) * 0.02
    x = torch.randn(37, 576, device="cuda", generator=g).bfloat16()
    lin = QuantLinear(w, kind=kind, smooth=torch.rand(576, device="cuda", generator=g) + 0.5)
    out = lin(x)
    assert out.dtype == torch.bfloat16 and out.shape == (37, 1024)
    assert _rel_err(out.float(), F.linear(x.float(), w)) < (0.03 if kind == "int8" else 0.08)
    if kind == "int8":  # exact integer sums
        assert all(torch.equal(lin(x[i:i + n]), out[i:i + n]) for i, n in ((0, 1), (5, 3), (20, 17)))


@pytest.mark.cuda
def test_cuda_int8_target_is_lossless(target_dir, good_draft_dir, spec):
    alone = LLM(str(target_dir), device="cuda", quantization="int8").generate(PROMPTS, _greedy())
    llm = LLM(str(target_dir), device="cuda", quantization="int8", speculative_config=spec(good_draft_dir, 3))
    outs = llm.generate(PROMPTS, _greedy())
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]


def test_the_cpu_path_sums_exactly_in_int32():
    """oneDNN only where its u8 x s8 sums are exact (VNNI/AMX); without them (avx2) it saturates, so _int_mm."""
    from specdec.engine.quant import onednn_int8_is_exact

    g = torch.Generator().manual_seed(5)
    lin = QuantLinear(torch.randn(64, 96, generator=g))
    x = torch.randn(7, 96, generator=g) * torch.linspace(0.1, 30, 96)  # rows whose int8 values reach +-127
    assert (lin.packed is not None) == onednn_int8_is_exact()
    xq, xs = quantize_rows(x)
    exact = (xq.double() @ lin.q.double().t()) * xs.double() * lin.scale.double()
    torch.testing.assert_close(lin(x).double(), exact, rtol=1e-5, atol=1e-4)
