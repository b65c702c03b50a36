"""Gateway settings: every field is a flag (--draft-addr) and an env var (SPECDEC_GATEWAY_DRAFT_ADDR)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.config import DEFAULT_NUM_SPECULATIVE_TOKENS

ENV_PREFIX = "SPECDEC_GATEWAY"


@dataclass
class GatewayConfig:
    draft_addr: str | None = field(default="localhost:50051", metadata={"help": "draft service host:port (none: target alone)"})
    target_addr: str = field(default="localhost:50052", metadata={"help": "target service host:port"})
    host: str = field(default="0.0.0.0", metadata={"help": "address to bind"})
    port: int = field(default=50050, metadata={"help": "gRPC port of GenerationService (0: any free port)"})
    http_port: int | None = field(default=None, metadata={"help": "OpenAI-compatible HTTP port (none: no HTTP; 0: any free port)"})
    api_key: str | None = field(default=None, metadata={"help": "when set, /v1/* needs 'Authorization: Bearer <key>'"})
    served_model_name: str | None = field(default=None, metadata={"help": "model id of /v1/models (default: the target's name)"})
    request_timeout_seconds: float | None = field(default=None, metadata={"help": "deadline of an HTTP request (none: no limit)"})
    num_speculative_tokens: int = field(default=DEFAULT_NUM_SPECULATIVE_TOKENS, metadata={"help": "k, drafts per round"})
    draft_sample_method: str = field(default="greedy", metadata={"help": "greedy or probabilistic"})
    use_heterogeneous_vocab: bool = field(default=False, metadata={"help": "allow a draft with another tokenizer (TLI)"})
    max_model_len: int | None = field(default=None, metadata={"help": "cap on prompt + output tokens (default: the backends')"})
    tokenizer: str | None = field(default=None, metadata={"help": "target tokenizer (default: the target's model name)"})
    backend_timeout_seconds: float = field(default=60.0, metadata={"help": "how long a backend call may retry an unavailable service"})
    startup_timeout_seconds: float = field(default=600.0, metadata={"help": "how long to wait for the backends at start-up"})
    max_concurrent_requests: int = field(default=64, metadata={"help": "streams served at once"})
    metrics_port: int | None = field(default=None, metadata={"help": "serve Prometheus /metrics on this HTTP port too "
                                                                     "(none: only on --http-port, if set; 0: any free port)"})
    log_requests: bool = field(default=False, metadata={"help": "include the prompt text in the per-request log line"})
