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
    tree_tile_rows: int = field(default=0, metadata={
        "help": "token trees: the rows a verify pass costs by; the trees of one pass are cut (each keeps its likeliest "
                "nodes) so that they fill no more such tiles than chains of their depths would. 0: by device (16 on "
                "a CPU, the batch-invariant tile; on CUDA measured at start: the most rows a pass holds for about "
                "one row's cost); -1: never cut"})
