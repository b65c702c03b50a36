"""Target service settings: every field is a flag (--max-batch-size) and an env var (SPECDEC_TARGET_MAX_BATCH_SIZE)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.serving.backend_service import BackendServiceConfig

ENV_PREFIX = "SPECDEC_TARGET"


@dataclass
class TargetServiceConfig(BackendServiceConfig):
    port: int = field(default=50052, metadata={"help": "gRPC port (0: any free port)"})
