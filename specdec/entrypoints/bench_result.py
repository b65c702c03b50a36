"""One benchmarked request's result, as ``specdec bench`` measures it over HTTP or gRPC (``bench``, ``bench_grpc``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")  # usage.spec_decode's counters


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    spec_decode: dict[str, Any] | None = None
