"""Gateway settings: every field is a flag (--draft-addr) and an env var (SPECDEC_GATEWAY_DRAFT_ADDR)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.config import spec_default
from specdec.serving.tls import server_tls_field

ENV_PREFIX = "SPECDEC_GATEWAY"


@dataclass
class GatewayConfig:
    draft_addr: str | None = field(default="localhost:50051", metadata={"help": "draft service host:port, several as "
                                                                            "host:port,host:port, or dns:///NAME:PORT "
                                                                            "(none: target alone)"})
    target_addr: str = field(default="localhost:50052", metadata={"help": "target service host:port, several as "
                                                                          "host:port,host:port, or dns:///NAME:PORT"})
    host: str = field(default="0.0.0.0", metadata={"help": "address to bind"})
    port: int = field(default=50050, metadata={"help": "gRPC port of GenerationService (0: any free port)"})
    http_port: int | None = field(default=None, metadata={"help": "OpenAI-compatible HTTP port (none: no HTTP; 0: any free port)"})
    api_key: list[str] = field(default_factory=list, metadata={
        "help": "when set, /v1/* and the gRPC GenerationService need 'Authorization: Bearer <key>' with one of the "
                "keys (repeat the flag, or comma-separate, for several)", "secret": True})
    api_key_file: str | None = field(default=None, metadata={"help": "file of accepted API keys, one per line "
                                                                     "(blank lines and '#' comments ignored)"})
    served_model_name: str | None = field(default=None, metadata={"help": "model id of /v1/models (default: the target's name)"})
    request_timeout_seconds: float | None = field(default=None, metadata={"help": "deadline of an HTTP request (none: no limit)"})
    num_speculative_tokens: int = field(default=spec_default("num_speculative_tokens"), metadata={"help": "k, drafts per round"})
    draft_sample_method: str = field(default=spec_default("draft_sample_method"), metadata={"help": "greedy or probabilistic"})
    use_heterogeneous_vocab: bool = field(default=spec_default("use_heterogeneous_vocab"), metadata={"help": "allow a draft with another tokenizer (TLI)"})
    max_model_len: int | None = field(default=None, metadata={"help": "cap on prompt + output tokens (default: the backends')"})
    tokenizer: str | None = field(default=None, metadata={"help": "target tokenizer (default: the target's model name)"})
    backend_timeout_seconds: float = field(default=60.0, metadata={"help": "how long a backend call may retry an unavailable service"})
    startup_timeout_seconds: float = field(default=600.0, metadata={"help": "how long to wait for the backends at start-up"})
    max_concurrent_requests: int = field(default=64, metadata={"help": "sequences generating at once (a request "
                                                                       "with n outputs counts n); HTTP and gRPC "
                                                                       "requests share these slots and the queue"})
    max_queue_len: int = field(default=256, metadata={"help": "sequences waiting for a slot; past that a request is "
                                                              "refused at once (HTTP 429 / RESOURCE_EXHAUSTED)"})
    max_queue_time_seconds: float | None = field(default=60.0, metadata={"help": "longest wait for a slot before the "
                                                                                 "request is refused (none: no limit)"})
    max_n: int = field(default=16, metadata={"help": "most outputs (n) one request may ask for"})
    max_request_body_bytes: int = field(default=4 * 1024 * 1024, metadata={"help": "largest request: HTTP body "
                                                                                  "(past it 413), gRPC message "
                                                                                  "(past it RESOURCE_EXHAUSTED)"})
    disable_by_batch_size: int | None = field(default=None, metadata={"help": "verify without drafts while this many "
                                                                             "sequences are generating (vLLM's name; "
                                                                             "none: always speculate)"})
    adaptive_k: bool = field(default=spec_default("adaptive_k"), metadata={"help": "each sequence picks its k per round (up to "
                                                              "--num-speculative-tokens) from its recent acceptance "
                                                              "and the measured cost of a round; a request's own "
                                                              "num_speculative_tokens pins it"})
    overlap: bool = field(default=spec_default("overlap"), metadata={
        "help": "overlapped drafting: the draft drafts each sequence's next round while the target verifies this "
                "one, on the bet that the round is accepted in full; a lost bet is dropped (lossless either way). "
                "Pays where draft and target run on their own cores or machines"})
    group_rounds: bool = field(default=True, metadata={"help": "step every live sequence's round together: one "
                                                               "batch of Propose calls, then one of Verify calls, each "
                                                               "service batching the phase whole (--no-group-rounds: "
                                                               "one independent loop per request)"})
    draft_fallback: bool = field(default=True, metadata={"help": "when the draft fails or times out, verify without "
                                                                 "drafts instead of failing (--no-draft-fallback: fail)"})
    draft_timeout_ms: float | None = field(default=None, metadata={"help": "deadline of one Propose call with the "
                                                                             "fallback on (none: 5x the slowest recent "
                                                                             "call, at least 2 s)"})
    draft_breaker_failures: int = field(default=3, metadata={"help": "consecutive draft failures that open the circuit "
                                                                     "breaker (rounds then skip the draft)"})
    draft_breaker_reset_seconds: float = field(default=5.0, metadata={"help": "how long the breaker stays open before "
                                                                              "one probe call tries the draft again"})
    metrics_port: int | None = field(default=None, metadata={"help": "serve Prometheus /metrics on this HTTP port too "
                                                                     "(none: only on --http-port, if set; 0: any free port)"})
    log_requests: bool = field(default=False, metadata={"help": "include the prompt text in the per-request log line"})
    tls_cert_file: str | None = server_tls_field("tls_cert_file")
    tls_key_file: str | None = server_tls_field("tls_key_file")
    tls_client_ca_file: str | None = server_tls_field("tls_client_ca_file")
    backend_tls_ca_file: str | None = field(default=None, metadata={
        "help": "PEM CA bundle that signed the draft/target services' certificates: talk TLS to them"})
    backend_tls_cert_file: str | None = field(default=None, metadata={
        "help": "PEM client certificate presented to the draft/target services (mutual TLS)"})
    backend_tls_key_file: str | None = field(default=None, metadata={"help": "PEM private key of --backend-tls-cert-file"})
    backend_tls_server_name: str | None = field(default=None, metadata={
        "help": "name the backends' certificates carry, when it is not the host of --draft-addr/--target-addr"})
    ssl_certfile: str | None = field(default=None, metadata={"help": "PEM certificate of the HTTP port: serve HTTPS"})
    ssl_keyfile: str | None = field(default=None, metadata={"help": "PEM private key of --ssl-certfile"})
