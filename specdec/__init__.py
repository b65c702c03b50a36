"""specdec: lossless speculative decoding (draft model, Token-Level Intersection) as gRPC microservices."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdec.config import SpeculativeConfig
    from specdec.llm import LLM, CompletionOutput, RequestOutput
    from specdec.sampling_params import SamplingParams, SpecDecodeStats

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "RequestOutput", "CompletionOutput", "SpecDecodeStats"]
__version__ = "0.1.0"

# Imported on first use (PEP 562): `python -m specdec.entrypoints.healthcheck`, run by container probes every few
# seconds, must not pay for importing torch and transformers.
_LAZY = {"LLM": "specdec.llm", "CompletionOutput": "specdec.llm", "RequestOutput": "specdec.llm",
         "SamplingParams": "specdec.sampling_params", "SpecDecodeStats": "specdec.sampling_params",
         "SpeculativeConfig": "specdec.config"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
