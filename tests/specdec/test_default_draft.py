"""The shipped default draft (distilled by `specdec distill`) drives lossless greedy output."""

import pytest

from specdec import LLM, SamplingParams
from specdec.config import DEFAULT_DRAFT, DEFAULT_TARGET, default_draft_path, default_speculative_config
from specdec.models import load_model

pytestmark = pytest.mark.slow


def test_default_draft_is_shipped_and_small():
    path = default_draft_path()
    assert path is not None, "specdec/assets/smollm2-135m-draft is missing: ship the distilled draft"
    work = {"cache", "checkpoint"}  # distillation work folders (git-ignored, never shipped)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not work & set(f.relative_to(path).parts))
    assert size < 60 * 2**20, f"the shipped draft takes {size / 2**20:.1f} MiB"
    assert (path / "README.md").exists(), "the model card records how the draft was made"
    assert default_speculative_config()["model"] == DEFAULT_DRAFT


def test_default_draft_shares_the_target_tokenizer():
    draft = load_model(DEFAULT_DRAFT)
    target = load_model(DEFAULT_TARGET)
    assert draft.tokenizer_fingerprint == target.tokenizer_fingerprint
    assert draft.model.num_parameters() < target.model.num_parameters() / 4


@pytest.mark.parametrize("k", [2, 4])
def test_default_pair_is_lossless_greedy(k):
    prompts = ["The history of the printing press begins", "def fibonacci(n):\n"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    spec = LLM(DEFAULT_TARGET, speculative_config={**default_speculative_config(), "num_speculative_tokens": k},
               dtype="float32")
    base = LLM(DEFAULT_TARGET, dtype="float32")
    outs, refs = spec.generate(prompts, params), base.generate(prompts, params)
    for out, ref in zip(outs, refs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.spec_decode_stats.num_accepted_tokens > 0, "the distilled draft should agree sometimes"
