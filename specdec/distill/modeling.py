"""Access to a transformers causal LM that the teacher, the draft and the loss share."""

from __future__ import annotations

from typing import Any


def final_softcap(config: Any) -> float | None:
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def body(model: Any) -> Any:
    """The decoder stack (``model.model`` for *ForCausalLM)."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model
