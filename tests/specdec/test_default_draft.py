"""The shipped default draft (distilled by `specdec distill`) drives lossless greedy output."""

import pytest

from specdec import LLM, SamplingParams
from specdec.config import (DEFAULT_DRAFT, DEFAULT_EAGLE3_HEAD, DEFAULT_TARGET, default_draft_path,
                            default_speculative_config, draft_model_pair_config)
from specdec.engine.models import load_model

pytestmark = pytest.mark.slow


def test_default_draft_is_shipped_and_small():
    path = default_draft_path()
    assert path is not None, "specdec/assets/smollm2-135m-draft is missing: ship the distilled draft"
    work = {"cache", "checkpoint"}  # distillation work folders (git-ignored, never shipped)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not work & set(f.relative_to(path).parts))
    assert size < 60 * 2**20, f"the shipped draft takes {size / 2**20:.1f} MiB"
    assert (path / "README.md").exists(), "the model card records how the draft was made"
    assert draft_model_pair_config()["model"] == DEFAULT_DRAFT
    assert default_speculative_config()["model"] == DEFAULT_EAGLE3_HEAD  # the default pair drafts with the head


def test_default_draft_shares_the_target_tokenizer():
    draft = load_model(DEFAULT_DRAFT)
    target = load_model(DEFAULT_TARGET)
    assert draft.tokenizer_fingerprint == target.tokenizer_fingerprint
    assert draft.model.num_parameters() < target.model.num_parameters() / 4


@pytest.mark.parametrize("pair", [default_speculative_config, draft_model_pair_config])
@pytest.mark.parametrize("k", [3, 8])
def test_default_pair_is_lossless_greedy(k, pair):
    """The default pair (suffix decoding before the EAGLE-3 head) and the suffix/draft-model pair."""
    prompts = ["The history of the printing press begins", "def fibonacci(n):\n"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    spec = LLM(DEFAULT_TARGET, speculative_config={**pair(), "num_speculative_tokens": k}, dtype="float32")
    base = LLM(DEFAULT_TARGET, dtype="float32")
    outs, refs = spec.generate(prompts, params), base.generate(prompts, params)
    for out, ref in zip(outs, refs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.spec_decode_stats.num_accepted_tokens > 0, "the distilled draft should agree sometimes"


def test_default_draft_runs_lean_over_its_draft_vocab():
    """The shipped draft_vocab.json loads; the draft worker's runner uses the lean forward over it and its
    logits equal transformers' on those ids (the others are -inf)."""
    import torch

    from specdec.engine.runner import ModelRunner
    from specdec.engine.lean_decoder import LeanDecoder

    draft = load_model(DEFAULT_DRAFT, dtype="float32")
    assert draft.draft_vocab is not None and len(draft.draft_vocab) == 16384
    assert ModelRunner(draft, 256, role="draft").quantization == "int8"  # the default; compared as computed here:
    runner = ModelRunner(draft, 256, role="draft", quantization="none")
    assert isinstance(runner.net, LeanDecoder) and runner.net.lm_head.out_features == 16384
    ids = draft.tokenizer("def fibonacci(n):\n    return").input_ids
    logits = runner.forward(runner.get_or_create("s", 0), ids)[0]
    with torch.inference_mode():
        ref = draft.model(torch.tensor([ids])).logits[0, -1]
    vocab = draft.draft_vocab
    torch.testing.assert_close(logits[vocab], ref[vocab], rtol=1e-4, atol=1e-4)
    assert torch.isneginf(logits).sum() == draft.vocab_size - len(vocab)
