"""Gateway settings: every field is a flag (--draft-addr) and an env var (SPECDEC_GATEWAY_DRAFT_ADDR)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from specdec.config import SpeculativeConfig, spec_default
from specdec.errors import ConfigError
from specdec.serving.tls import check_ca_file, check_key_pair, server_tls_field

# --ssl-cert-reqs, as vLLM's (Python's ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED)
SSL_CERT_REQS = (0, 1, 2)


def parse_cert_reqs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value not in SSL_CERT_REQS:
        raise ValueError(f"{text!r} is not 0 (none), 1 (optional) or 2 (required)")
    return value

ENV_PREFIX = "SPECDEC_GATEWAY"


@dataclass
class GatewayConfig:
    draft_addr: str | None = field(default="localhost:50051", metadata={"help": "draft service host:port, several as "
                                                                            "host:port,host:port, or dns:///NAME:PORT "
                                                                            "(none: target alone)"})
    target_addr: str = field(default="localhost:50052", metadata={"help": "target service host:port, several as "
                                                                          "host:port,host:port, or dns:///NAME:PORT"})
    dns_refresh_seconds: float = field(default=30.0, metadata={
        "help": "how often a dns:///NAME:PORT address is resolved again (replicas that joined are added; those that "
                "left take no new sequence and are dropped once their sequences end)"})
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
    speculative_config: str | None = field(default=None, metadata={
        "help": "the same JSON as specdec serve's --speculative-config (one config for the three parts): the gateway "
                "takes num_speculative_tokens, draft_sample_method, use_heterogeneous_vocab, disable_by_batch_size, "
                "adaptive_k, overlap and max_model_len from it and checks the rest (the draft service's keys)"})
    num_speculative_tokens: int = field(default=spec_default("num_speculative_tokens"), metadata={"help": "k, drafts per round"})
    draft_sample_method: str = field(default=spec_default("draft_sample_method"), metadata={"help": "greedy or probabilistic"})
    use_heterogeneous_vocab: bool = field(default=spec_default("use_heterogeneous_vocab"), metadata={"help": "allow a draft with another tokenizer (TLI)"})
    max_model_len: int | None = field(default=None, metadata={"help": "cap on prompt + output tokens (default: the backends')"})
    tokenizer: str | None = field(default=None, metadata={"help": "target tokenizer (default: the target's model name)"})
    backend_timeout_seconds: float = field(default=60.0, metadata={"help": "how long a backend call may retry an unavailable service"})
    backend_call_timeout_floor_seconds: float = field(default=10.0, metadata={
        "help": "shortest deadline of a backend call (Propose, Verify) the client set no tighter deadline for; a "
                "call past its deadline fails with UNAVAILABLE (another replica takes the sequence, or the client "
                "gets 503), so a hung backend is found in seconds"})
    backend_call_timeout_factor: float = field(default=8.0, metadata={
        "help": "a backend call's deadline is this many times the slowest recent call of that backend (per token "
                "sent, for a long prefill), at least --backend-call-timeout-floor-seconds"})
    group_stall_seconds: float = field(default=1.0, metadata={
        "help": "with group rounds, how long a step may run (at least; also 4x the median recent step) before the "
                "sequences not in it step without it (a hung call or a long prefill holds up only its own)"})
    drain_grace_seconds: float = field(default=25.0, metadata={
        "help": "on SIGTERM: readiness turns false (gRPC health NOT_SERVING, HTTP /ready 503), new requests get "
                "503 / UNAVAILABLE, and requests in flight get this long to finish before the process exits "
                "(keep it under Kubernetes' terminationGracePeriodSeconds)"})
    startup_timeout_seconds: float = field(default=600.0, metadata={"help": "how long to wait for the backends at start-up"})
    max_concurrent_requests: int = field(default=64, metadata={"help": "sequences generating at once (a request "
                                                                       "with n outputs counts n); HTTP and gRPC "
                                                                       "requests share these slots and the queue"})
    max_queue_len: int = field(default=256, metadata={"help": "sequences waiting for a slot; past that a request is "
                                                              "refused at once (HTTP 429 / RESOURCE_EXHAUSTED)"})
    max_queue_time_seconds: float | None = field(default=60.0, metadata={"help": "longest wait for a slot before the "
                                                                                 "request is refused (none: no limit)"})
    scheduling_policy: str = field(default="fcfs", metadata={
        "help": "the order in which waiting sequences get a slot: fcfs (first come, first served) or priority (a "
                "request's priority field, lower first, then arrival; vLLM's --scheduling-policy)"})
    max_n: int = field(default=16, metadata={"help": "most outputs (n) one request may ask for"})
    responses_store_max_entries: int = field(default=1024, metadata={
        "help": "most responses the Responses API keeps for previous_response_id and GET /v1/responses/{id} "
                "(store: true; in this gateway's memory, least recently used dropped first; 0: keep none)"})
    responses_store_max_bytes: int = field(default=64 * 1024 * 1024, metadata={
        "help": "most bytes of stored responses (as JSON; each keeps its whole conversation)"})
    responses_store_ttl_seconds: float | None = field(default=3600.0, metadata={
        "help": "a stored response not read or continued for this long is dropped (none: only the bounds drop "
                "them)"})
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
    ssl_ca_certs: str | None = field(default=None, metadata={
        "help": "PEM CA bundle that HTTPS clients' certificates are checked against (with --ssl-cert-reqs 1 or 2)"})
    ssl_cert_reqs: int = field(default=0, metadata={
        "parse": parse_cert_reqs, "metavar": "{0,1,2}",
        "help": "client certificates on the HTTPS port, as Python's ssl.CERT_*: 0 none, 1 optional (checked when "
                "sent), 2 required (a client without one signed by --ssl-ca-certs fails the handshake)"})


# GatewayConfig field -> the speculative_config key it is (specdec serve and --speculative-config fill them)
SPEC_KEYS = {"num_speculative_tokens": "num_speculative_tokens", "draft_sample_method": "draft_sample_method",
             "use_heterogeneous_vocab": "use_heterogeneous_vocab", "disable_by_batch_size": "disable_by_batch_size",
             "adaptive_k": "adaptive_k", "overlap": "overlap", "max_model_len": "max_model_len"}


def with_speculative_config(config: GatewayConfig) -> GatewayConfig:
    """``config`` with the gateway's keys of ``--speculative-config`` applied (the whole config is checked, as
    serve checks it). A flag set to another value than the config's is a ConfigError naming both."""
    if not config.speculative_config:
        return config
    spec = SpeculativeConfig.from_any(config.speculative_config)
    defaults = GatewayConfig()
    values = {}
    for name, key in SPEC_KEYS.items():
        value, own = getattr(spec, key), getattr(config, name)
        if name == "max_model_len":
            if value is None:
                continue
            value = min(value, own) if own is not None else value  # the shorter of the two contexts
        elif own != getattr(defaults, name) and own != value:
            raise ConfigError(f"--{name.replace('_', '-')} {own!r} and --speculative-config's {key} {value!r} "
                              "disagree; give one of them")
        values[name] = value
    return dataclasses.replace(config, **values)


def https_settings(config: GatewayConfig) -> dict:
    """uvicorn's TLS settings (``ssl_certfile``, ``ssl_keyfile``, ``ssl_ca_certs``, ``ssl_cert_reqs``) from the
    gateway's ``--ssl-*`` flags, every file checked now ({}: plain HTTP). A ConfigError names the flag."""
    if not check_key_pair(config.ssl_certfile, config.ssl_keyfile, "--ssl-certfile", "--ssl-keyfile"):
        if config.ssl_ca_certs is not None or config.ssl_cert_reqs:
            raise ConfigError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile and --ssl-keyfile (HTTPS)")
        return {}
    if config.ssl_cert_reqs and config.ssl_ca_certs is None:
        raise ConfigError(f"--ssl-cert-reqs {config.ssl_cert_reqs} needs --ssl-ca-certs: the CA that signs the "
                          "clients' certificates")
    if config.ssl_ca_certs is not None:
        check_ca_file(config.ssl_ca_certs, "--ssl-ca-certs")
    return {"ssl_certfile": config.ssl_certfile, "ssl_keyfile": config.ssl_keyfile,
            "ssl_ca_certs": config.ssl_ca_certs, "ssl_cert_reqs": config.ssl_cert_reqs}
