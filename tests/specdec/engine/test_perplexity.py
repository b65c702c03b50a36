"""specdec.engine.perplexity: the shipped texts, and perplexity through transformers' forward and the lean
decoder. The tiny random-weight target of tests/conftest.py here; the real SmolLM2-135M at the end (slow)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from specdec.engine.lean_decoder import LeanDecoder

from specdec.engine.lean_forward import lean_decoder
from specdec.engine.perplexity import TEXT_DIR, TEXTS, perplexity, shipped_text, text_perplexity, windows
from tests.conftest import PROMPTS as CONFTEST_PROMPTS

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def heldout_ids(tokenizer) -> list[int]:
    return tokenizer(shipped_text("heldout"), add_special_tokens=True).input_ids[:200]


@pytest.fixture(scope="module")
def lean_target(target_model) -> LeanDecoder:
    lean = lean_decoder(target_model)
    assert isinstance(lean, LeanDecoder)
    return lean


def _reference_nll(model, ids: list[int]) -> tuple[float, int]:
    """(summed NLL, predicted tokens) of one sequence by one full forward of the model, no cache."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), use_cache=False).logits[0].float()
    return float(F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum")), len(ids) - 1


# --------------------------------------------------------------------------------------------------
# the windows


def test_windows_non_overlapping_and_sliding():
    assert windows(10, 4, 4) == [(0, 4, 1), (4, 8, 5), (8, 10, 9)]  # each window's first token is unpredicted
    assert windows(10, 4, 2) == [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]  # the last `stride` tokens
    assert windows(9, 4, 4) == [(0, 4, 1), (4, 8, 5)]  # a last window of one token predicts nothing
    assert windows(3, 8, 8) == [(0, 3, 1)]
    for length, window, stride in [(100, 16, 16), (100, 16, 5), (37, 8, 3)]:
        targets = [t for _, end, first in windows(length, window, stride) for t in range(first, end)]
        if stride == window:
            assert targets == [t for t in range(1, length) if t % window]
        else:
            assert targets == list(range(1, length))  # every token after the first, once
        for begin, end, first in windows(length, window, stride):
            assert end - begin <= window and begin < first


def test_bad_arguments(target_model):
    for kwargs in [dict(window=1), dict(window=8, stride=9), dict(window=8, stride=0)]:
        with pytest.raises(ValueError, match="window"):
            perplexity(target_model, [1, 2, 3], **kwargs)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(target_model, [1])


# --------------------------------------------------------------------------------------------------
# against hand computations


def test_one_window_equals_one_full_forward(target_model, heldout_ids):
    ids = heldout_ids[:50]
    total, n = _reference_nll(target_model, ids)
    for window in (50, 64):
        out = perplexity(target_model, ids, window=window)
        assert out["tokens"] == n == 49
        assert out["nll"] == pytest.approx(total / n, rel=1e-5)
        assert out["perplexity"] == pytest.approx(math.exp(total / n), rel=1e-5)


def test_two_windows_are_two_independent_sequences(target_model, heldout_ids):
    ids = heldout_ids[:61]
    (a, na), (b, nb) = _reference_nll(target_model, ids[:31]), _reference_nll(target_model, ids[31:])
    out = perplexity(target_model, torch.tensor(ids), window=31)
    assert out["tokens"] == na + nb == 59
    assert out["nll"] == pytest.approx((a + b) / (na + nb), rel=1e-5)


def test_sliding_scores_the_last_stride_tokens_with_the_window_before(target_model, heldout_ids):
    ids = heldout_ids[:40]
    with torch.inference_mode():
        first = target_model(torch.tensor([ids[:24]])).logits[0].float().log_softmax(-1)
        second = target_model(torch.tensor([ids[16:40]])).logits[0].float().log_softmax(-1)
    # window 24, stride 16: targets 1..23 from the first window, 24..39 from the second (its rows 7..22)
    nll = -sum(float(first[t - 1, ids[t]]) for t in range(1, 24)) - sum(float(second[t - 17, ids[t]]) for t in range(24, 40))
    out = perplexity(target_model, ids, window=24, stride=16)
    assert out["tokens"] == 39
    assert out["nll"] == pytest.approx(nll / 39, rel=1e-5)


class _BigramLM(torch.nn.Module):
    """A causal LM whose logits put ``boost`` on ``next_of[token]`` and 0 elsewhere (boost 0: uniform)."""

    def __init__(self, next_of: torch.Tensor, boost: float):
        super().__init__()
        self.register_buffer("next_of", next_of)
        self.boost = boost
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, position_ids=None, past_key_values=None, use_cache=True):  # the 4.x signature
        return SimpleNamespace(logits=self.boost * F.one_hot(self.next_of[input_ids], self.next_of.numel()).float())


def test_a_model_that_favours_the_true_next_token(target_model):
    """Tokens that follow a permutation: a model that knows it gets exactly log(1 + (V - 1) e^-boost) per token,
    a uniform one exactly log(V), and the tiny random target (which does not know it) far more than the first."""
    vocab = target_model.config.vocab_size
    next_of = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    ids = [7]
    for _ in range(99):
        ids.append(int(next_of[ids[-1]]))
    for boost in (0.0, 4.0, 12.0):  # (at 20 the NLL, ~1e-4, is below fp32's resolution of the logsumexp ~20)
        for window, stride in [(32, None), (32, 8), (100, None)]:
            out = perplexity(_BigramLM(next_of, boost), ids, window=window, stride=stride)
            # fp32 log-softmax over 49,152 logits: within ~6e-5 nats measured
            assert out["nll"] == pytest.approx(math.log1p((vocab - 1) * math.exp(-boost)), rel=1e-4, abs=2e-4)
    assert perplexity(_BigramLM(next_of, 0.0), ids, window=32)["perplexity"] == pytest.approx(vocab, rel=1e-4)
    oracle = perplexity(_BigramLM(next_of, 20.0), ids, window=32)
    assert oracle["perplexity"] < 1.01
    assert perplexity(target_model, ids, window=32)["perplexity"] > 100 * oracle["perplexity"]


# --------------------------------------------------------------------------------------------------
# lean decoder vs transformers


@pytest.mark.parametrize("window, stride", [(64, None), (200, None), (48, 20)])
def test_lean_decoder_equals_transformers(target_model, lean_target, heldout_ids, window, stride):
    ref = perplexity(target_model, heldout_ids, window=window, stride=stride)
    lean = perplexity(lean_target, heldout_ids, window=window, stride=stride)
    assert lean["tokens"] == ref["tokens"]
    assert lean["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-4)


def test_text_perplexity_tokenizes_and_truncates(target_model, lean_target, tokenizer):
    text = shipped_text("heldout")
    ids = tokenizer(text, add_special_tokens=True).input_ids
    assert len(ids) > 300
    out = text_perplexity(lean_target, tokenizer, text, window=64, max_tokens=150)
    assert out["tokens"] == 150 - 3  # windows of 64, 64 and 22 tokens
    assert out == perplexity(lean_target, ids[:150], window=64)


# --------------------------------------------------------------------------------------------------
# the shipped texts


def _sentences(text: str) -> set[str]:
    return {" ".join(s.split()) for s in text.split(". ") if s.strip()}


def _prompts() -> list[str]:
    found: list[str] = list(CONFTEST_PROMPTS)

    def walk(node, key=""):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, k)
        elif isinstance(node, list):
            for v in node:
                walk(v, key)
        elif isinstance(node, str) and not key.startswith("_"):
            found.append(node)

    for path in sorted((ROOT / "specdec" / "assets" / "prompts").glob("*.json")):
        walk(json.loads(path.read_text()))
    return found


def test_shipped_texts_are_substantial_and_disjoint():
    texts = {name: shipped_text(name) for name in TEXTS}
    assert set(texts) == {"calibration", "heldout"}
    for text in texts.values():
        assert 1500 <= len(text.split()) <= 2200
        assert len(set(re.findall(r"[a-z]+", text.lower()))) > 600  # varied prose, not a repeated phrase
        assert re.search(r"\d", text)
    shared = _sentences(texts["calibration"]) & _sentences(texts["heldout"])
    assert not shared


def test_shipped_texts_contain_no_test_prompt():
    prompts = _prompts()
    assert len(prompts) >= 20
    for name in TEXTS:
        text = shipped_text(name)
        assert not [p for p in prompts if p.strip() in text]


def test_bad_text_name():
    with pytest.raises(ValueError, match=r"calibration.*heldout"):
        shipped_text("training")


def test_texts_are_package_data():
    tomllib = pytest.importorskip("tomllib")
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["specdec"]
    package = ROOT / "specdec"
    covered = {p for pattern in patterns for p in package.glob(pattern)}
    assert TEXT_DIR == package / "assets" / "text"
    for name in TEXTS:
        assert TEXT_DIR / f"{name}.txt" in covered


# --------------------------------------------------------------------------------------------------
# the real SmolLM2-135M (slow)


@pytest.mark.slow
def test_real_smollm2_heldout_perplexity():
    """Measured (fp32, CPU, 1 thread): 2,399 tokens (SmolLM2's tokenizer adds no BOS), 5 windows of up to 512,
    2,394 predicted; perplexity 20.9458 through transformers and the lean decoder alike (relative difference
    2e-7); about 35 s with the model's first load."""
    from specdec.engine.models import load_model
    from tests.specdec.tli.tiny_tli import require_packages

    require_packages("smollm2-135m")
    lm = load_model("smollm2-135m")
    text = shipped_text("heldout")
    ref = text_perplexity(lm.model, lm.tokenizer, text, window=512)
    lean = text_perplexity(lean_decoder(lm.model), lm.tokenizer, text, window=512)
    print(f"\nSmolLM2-135M heldout: transformers {ref}, lean {lean}")
    assert lean["tokens"] == ref["tokens"] > 1500
    assert lean["perplexity"] == pytest.approx(ref["perplexity"], rel=0.005)
    assert 1 < ref["perplexity"] < 100
