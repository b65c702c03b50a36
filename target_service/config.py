"""Target service settings: every field is a flag (--max-batch-size) and an env var (SPECDEC_TARGET_MAX_BATCH_SIZE)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.backend import BackendConfig

ENV_PREFIX = "SPECDEC_TARGET"


@dataclass
class TargetServiceConfig(BackendConfig):
    host: str = field(default="0.0.0.0", metadata={"help": "address to bind"})
    port: int = field(default=50052, metadata={"help": "gRPC port (0: any free port)"})
