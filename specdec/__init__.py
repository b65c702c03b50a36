"""specdec: lossless speculative decoding (draft model, Token-Level Intersection) as gRPC microservices."""

from specdec.config import SpeculativeConfig
from specdec.llm import LLM, CompletionOutput, RequestOutput
from specdec.sampling import SamplingParams, SpecDecodeStats

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "RequestOutput", "CompletionOutput", "SpecDecodeStats"]
__version__ = "0.1.0"
