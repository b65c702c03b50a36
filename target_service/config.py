"""Target service settings: every field is a flag (--max-batch-size) and an env var (SPECDEC_TARGET_MAX_BATCH_SIZE)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.seeding import DEFAULT_SEEDED_SAMPLING, SEEDED_SAMPLING
from specdec.serving.backend_service import BackendServiceConfig

ENV_PREFIX = "SPECDEC_TARGET"


@dataclass
class TargetServiceConfig(BackendServiceConfig):
    port: int = field(default=50052, metadata={"help": "gRPC port (0: any free port)"})
    seeded_sampling: str = field(default=DEFAULT_SEEDED_SAMPLING, metadata={
        "help": f"the rule of requests with a seed and temperature > 0, one of {list(SEEDED_SAMPLING)}: coupled (the "
                "text depends on the seed only, not on the draft, k, speculation or outages) or rejection "
                "(Leviathan/Chen rejection sampling, as requests without a seed)"})
