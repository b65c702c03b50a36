"""Loading causal LMs (torch): a model's name is resolved to its files, and its tokenizer loaded, by
``specdec.model_files`` (no torch there); the weights are loaded here, in the dtype asked for or measured."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.engine.lean_linear import use_skinny_matmuls
# resolution, the GGUF cache and tokenizers (no torch)
from specdec.model_files import (model_construction, resolve_model_path, shared_tokenizer,
                                 tokenizer_fingerprint)

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def is_auto_dtype(dtype: str | torch.dtype | None) -> bool:
    return dtype is None or (isinstance(dtype, str) and dtype.strip().lower() == "auto")


def parse_dtype(dtype: str | torch.dtype | None, device: str | torch.device = "cpu") -> torch.dtype:
    """An explicit dtype as named. ``None``/``"auto"``: bfloat16 on CUDA; on CPU, without a model to measure,
    ``$SPECDEC_DTYPE_AUTO`` where an operator pinned it, else float32. :func:`load_model` resolves a CPU
    ``auto`` by measurement instead (:mod:`specdec.engine.dtype_choice`)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if is_auto_dtype(dtype):
        if torch.device(device).type == "cuda":
            return torch.bfloat16
        if torch.device(device).type == "cpu":
            from specdec.engine.dtype_choice import pinned_dtype

            return pinned_dtype() or torch.float32
        return torch.float32
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(set(DTYPES))} or 'auto'") from None


# --------------------------------------------------------------------------------------------------
# Resolution and loading


@dataclass
class LoadedModel:
    """A model ready for inference, with what services report about it in GetInfo."""

    name: str
    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    source: str
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    # The ids this model proposes when it serves as a draft (DRAFT_VOCAB_FILE in its folder), or None: all.
    draft_vocab: torch.Tensor | None = None

    @property
    def vocab_size(self) -> int:
        """Size of the logits dimension (may exceed len(tokenizer) where embeddings are padded)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def tokenizer_fingerprint(self) -> str:
        return tokenizer_fingerprint(self.tokenizer)


def _tie_missing_lm_head(model: Any) -> None:
    """A checkpoint saved with tied embeddings has no lm_head; tie it if loading left it empty (meta)."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is not None and out.weight.is_meta and inp is not None and out.weight.shape == inp.weight.shape:
        out.weight = inp.weight
    empty = [name for name, p in model.named_parameters() if p.is_meta]
    if empty:
        raise RuntimeError(f"weights missing from the checkpoint: {empty[:5]}")


def load_model(
    name: str,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    revision: str | None = None,
) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    torch_dtype = parse_dtype(dtype, device)  # an unknown name fails before any loading
    path, kwargs = resolve_model_path(name, revision)
    if is_auto_dtype(dtype) and torch.device(device).type == "cpu":
        torch_dtype = _cpu_auto_dtype(path, kwargs)
    tokenizer = shared_tokenizer(path, kwargs)
    with model_construction():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kwargs)
    _tie_missing_lm_head(model)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    if torch.device(device).type == "cpu" and torch_dtype == torch.float32:
        use_skinny_matmuls(model)
    eos: set[int] = set()
    for src in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            eos.add(src)
        elif src:
            eos.update(int(x) for x in src)
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        source=path,
        dtype=torch_dtype,
        device=torch.device(device),
        eos_token_ids=frozenset(eos),
        draft_vocab=load_draft_vocab(path, int(model.get_output_embeddings().weight.shape[0])),
    )


def _cpu_auto_dtype(path: str, kwargs: dict[str, Any]) -> torch.dtype:
    """``auto`` on CPU: the faster of float32 and bfloat16 for this model's size on this machine (measured
    once and cached; :mod:`specdec.engine.dtype_choice`), unless ``$SPECDEC_DTYPE_AUTO`` pins it."""
    from transformers import AutoConfig

    from specdec.engine import dtype_choice

    pin = dtype_choice.pinned_dtype()
    if pin is not None:
        logger.info("dtype auto: %s", dtype_choice.DtypeChoice(pin, "pinned").describe())
        return pin
    text = AutoConfig.from_pretrained(path, **kwargs).get_text_config()
    hidden, intermediate = getattr(text, "hidden_size", None), getattr(text, "intermediate_size", None)
    if not (isinstance(hidden, int) and isinstance(intermediate, int) and hidden > 0 and intermediate > 0):
        logger.info("dtype auto: float32 (%s's config has no hidden_size / intermediate_size to measure by)", path)
        return torch.float32
    with model_construction():  # not while this process builds another model: that would skew the timings
        choice = dtype_choice.cpu_auto_choice(hidden, intermediate)
    logger.info("dtype auto: %s", choice.describe())
    return choice.dtype


DRAFT_VOCAB_FILE = "draft_vocab.json"


def load_draft_vocab(folder: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The sorted token ids of ``folder``'s draft vocabulary (``draft_vocab.json``: {"token_ids": [...]}),
    or None when the folder has none. A draft drafts only over these ids (its other logits are -inf):
    computing a few thousand rows of the LM head instead of the whole vocabulary makes a small draft's
    step several times cheaper, while the target's frequent tokens stay proposable."""
    path = Path(folder) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())["token_ids"]
        vocab = torch.tensor(sorted(set(int(i) for i in ids)), dtype=torch.long)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: expected {{\"token_ids\": [ints]}} ({exc})") from None
    if len(vocab) == 0 or vocab[0] < 0 or vocab[-1] >= vocab_size:
        raise ValueError(f"{path}: token ids must be a non-empty list within [0, {vocab_size})")
    return vocab


DEFAULT_MAX_MODEL_LEN = 8192  # for a model whose config names no context length


def model_max_len(lm: LoadedModel) -> int:
    """The model's context length (max_position_embeddings)."""
    cfg = lm.model.config.get_text_config()
    return int(getattr(cfg, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN)
