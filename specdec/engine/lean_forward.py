"""The lean forward for a model: which lean decoder class runs its architecture (``lean_decoder`` for the Llama
family, ``lean_gemma3`` for Gemma-3), why none can, and one built for it."""

from __future__ import annotations

from typing import Any

import torch

from specdec.engine.lean_decoder import LeanDecoder
from specdec.engine.lean_gemma3 import LeanGemma3Decoder
from specdec.engine.quant_plan import QuantPlan


def decoder_class(model: Any) -> type[LeanDecoder]:
    """The lean decoder class for ``model``'s architecture (whether it supports this model or not)."""
    if getattr(model.config, "model_type", None) == "gemma3_text":
        return LeanGemma3Decoder
    return LeanDecoder


def unsupported_reason(model: Any) -> str | None:
    """Why no lean decoder can run ``model`` (None: one can)."""
    return decoder_class(model).unsupported_reason(model)


def lean_decoder(model: Any, vocab_subset: torch.Tensor | None = None, use_onednn: bool = True,
                 batch_invariant: bool = False, quant: QuantPlan | None = None) -> LeanDecoder | None:
    """A lean decoder for ``model`` (see :func:`decoder_class`), or None where it is unsupported."""
    cls = decoder_class(model)
    if cls.unsupported_reason(model) is not None:
        return None
    return cls(model, vocab_subset, use_onednn, batch_invariant, quant)
