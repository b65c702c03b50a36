"""LLM(kernels="triton") end to end on the tiny random-weight pair (Triton's interpreter on a CPU):
greedy output equals the target alone, seeded sampling equals the torch path token for token, and the
first emitted token follows the target's distribution (chi-square), which a deliberately broken kernel
(recovered token drawn from p instead of max(p - q, 0), injected by monkeypatch) fails."""

from __future__ import annotations

import importlib.util
import inspect
from collections import Counter

import pytest
import torch

import kernels.rejection
from specdec import LLM, SamplingParams
from specdec.sampling import process_logits
from tests.kernels.conftest import DEVICE

pytestmark = pytest.mark.usefixtures("cached_model_loading")
PROMPT = "The quick brown fox"  # the target's first token at T=1: 0.43, 0.36, 0.08, ...
N_FIRST = 100  # samples per chi-square run (the broken kernel gives p < 1e-6 here; the real one p > 0.05)


def _llm(target_dir, draft_dir, spec, kernels, method="probabilistic", k=3, seeded_sampling="rejection"):
    """Seeded requests are sampled by rejection unless asked (the kernel's sampled rows are what these test)."""
    llm = LLM(str(target_dir), speculative_config=spec(draft_dir, k, draft_sample_method=method), dtype="float32",
              device=DEVICE, kernels=kernels, seeded_sampling=seeded_sampling)
    assert llm._target_worker.kernels == kernels
    return llm


def test_greedy_output_equals_the_target_alone(target_dir, good_draft_dir, spec, target_greedy_ref):
    llm = _llm(target_dir, good_draft_dir, spec, "triton", method="greedy")
    for prompt, (ids, ref) in target_greedy_ref.items():
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        got = out[0].outputs[0]
        assert got.token_ids == ref[:24], prompt
        assert 0 < got.spec_decode_stats.num_accepted_tokens < got.spec_decode_stats.num_draft_tokens  # both outcomes


@pytest.mark.heavy
@pytest.mark.parametrize("seeded_sampling", ["rejection", "coupled"])
@pytest.mark.parametrize("method, params", [
    ("probabilistic", SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)),
    ("greedy", SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True)),
    ("probabilistic", SamplingParams(temperature=1.0, top_k=20, max_tokens=16, ignore_eos=True)),
], ids=["probabilistic-T1", "greedydraft-topp", "probabilistic-topk"])
def test_seeded_sampling_equals_the_torch_path(target_dir, good_draft_dir, spec, method, params, seeded_sampling):
    outs = {}
    for kernels in ("torch", "triton"):
        llm = _llm(target_dir, good_draft_dir, spec, kernels, method=method, seeded_sampling=seeded_sampling)
        outs[kernels] = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * 4, [params.clone(seed=s) for s in range(4)])]
    assert outs["triton"] == outs["torch"]
    assert len({tuple(t) for t in outs["torch"]}) > 1  # the seeds made different samples


def _first_tokens(llm, n: int, seed: int) -> Counter:
    params = SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=3, ignore_eos=True)
    out = llm.generate(PROMPT, params)[0]
    stats = out.spec_decode_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats.as_dict()  # accepts and rejects
    return Counter(o.token_ids[0] for o in out.outputs)


@pytest.fixture(scope="module")
def p_first(target_model, tokenizer):
    with torch.inference_mode():
        logits = target_model(torch.tensor([tokenizer(PROMPT).input_ids])).logits[0, -1]
    return process_logits(logits, SamplingParams(temperature=1.0))


def _broken_accept_kernel(tmp_path):
    """The real accept kernel with one mistake: at a rejection the race runs on p, not on max(p - q, 0)."""
    kernel = kernels.rejection._accept_kernel
    source = inspect.getsource(kernel.fn)
    right = ["residual = tl.maximum(p - q, 0.0)", "residual = tl.where(one_hot & (cols == d_n), 0.0, residual)"]
    for line in right:
        assert line in source, "the kernel changed: update this negative control"
    source = source.replace(right[0], "residual = p").replace(right[1], "residual = residual")
    path = tmp_path / "broken_accept_kernel.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n" + source)
    spec = importlib.util.spec_from_file_location("broken_accept_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._accept_kernel


@pytest.mark.slow  # ~15 s on 2 cores: 2 x 100 generations through the interpreted kernels
def test_first_token_follows_the_target_and_a_broken_kernel_is_detected(
        target_dir, good_draft_dir, spec, p_first, chi2_pvalue, monkeypatch, tmp_path):
    """Greedy drafting under a sampling target: the draft's token is accepted with probability p(x); the
    residual excludes it after a rejection. Drawing the recovered token from p instead over-produces x."""
    llm = _llm(target_dir, good_draft_dir, spec, "triton", method="greedy", k=2)
    counts = _first_tokens(llm, N_FIRST, seed=31)
    pv = chi2_pvalue([counts[t] for t in range(p_first.numel())], p_first)
    print(f"chi-square p={pv:.3g}")
    assert pv > 1e-3, f"Triton path: first tokens do not follow p (p-value {pv:.3g}): {counts.most_common(5)}"

    monkeypatch.setattr(kernels.rejection, "_accept_kernel", _broken_accept_kernel(tmp_path))
    counts = _first_tokens(llm, N_FIRST, seed=31)
    pv = chi2_pvalue([counts[t] for t in range(p_first.numel())], p_first)
    print(f"chi-square p={pv:.3g}")
    assert pv < 1e-3, f"the broken kernel passed the chi-square test (p-value {pv:.3g}): {counts.most_common(5)}"
