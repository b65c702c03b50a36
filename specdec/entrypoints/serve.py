"""``specdec serve [TARGET] --speculative-config '{...}'``: draft, target and gateway on this machine.

Like ``vllm serve``. With no TARGET it serves the embedded default pair. The three parts are the
same servers the containers run alone (``specdec draft-service`` / ``target-service`` / ``gateway``),
started in one process here, the backends on loopback ports.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field

from specdec.serving import settings
from specdec.serving.tls import server_tls_field
from specdec.config import DEFAULT_TARGET, SpeculativeConfig, default_speculative_config, legacy_speculative_config

logger = logging.getLogger(__name__)
ENV_PREFIX = "SPECDEC_SERVE"


@dataclass
class ServeConfig:
    model: str | None = field(default=None, metadata={"help": "target model (positional TARGET; default: the embedded default pair)"})
    speculative_config: str | None = field(default=None, metadata={"help": "JSON: {\"method\": \"draft_model\", \"model\": DRAFT, \"num_speculative_tokens\": k, ...}"})
    host: str = field(default="0.0.0.0", metadata={"help": "address the gateway binds"})
    port: int = field(default=8000, metadata={"help": "OpenAI-compatible HTTP port (-1: no HTTP)"})
    api_key: list[str] = field(default_factory=list, metadata={
        "help": "when set, /v1/* and the gRPC GenerationService need 'Authorization: Bearer <key>' with one of the "
                "keys (repeat the flag, or comma-separate, for several)", "secret": True})
    api_key_file: str | None = field(default=None, metadata={"help": "file of accepted API keys, one per line "
                                                                     "(blank lines and '#' comments ignored)"})
    ssl_certfile: str | None = field(default=None, metadata={"help": "PEM certificate of the HTTP port: serve HTTPS"})
    ssl_keyfile: str | None = field(default=None, metadata={"help": "PEM private key of --ssl-certfile"})
    served_model_name: str | None = field(default=None, metadata={"help": "model id clients send (default: TARGET)"})
    grpc_port: int = field(default=50050, metadata={"help": "gateway GenerationService gRPC port"})
    tls_cert_file: str | None = server_tls_field("tls_cert_file")
    tls_key_file: str | None = server_tls_field("tls_key_file")
    tls_client_ca_file: str | None = server_tls_field("tls_client_ca_file")
    seed: int = field(default=0, metadata={"help": "global random seed (requests without a seed)"})
    max_model_len: int | None = field(default=None, metadata={"help": "cap on prompt + output tokens"})
    dtype: str = field(default="auto", metadata={"help": "target dtype: float32 (auto on CPU) or bfloat16"})
    draft_dtype: str | None = field(default=None, metadata={"help": "draft dtype (default: --dtype)"})
    max_sequences: int = field(default=256, metadata={"help": "cached sequences per backend"})
    max_batch_size: int = field(default=16, metadata={"help": "sequences per batched forward pass"})
    num_threads: int = field(default=0, metadata={"help": "CPU threads of the forward passes (0: all cores); draft and "
                                                   "target take turns on one compute thread"})
    metrics_port: int | None = field(default=None, metadata={"help": "also serve Prometheus /metrics on this port (the "
                                                                     "HTTP port serves it anyway)"})
    log_requests: bool = field(default=False, metadata={"help": "include the prompt text in the per-request log line"})
    group_rounds: bool = field(default=True, metadata={"help": "step every live sequence's round together (one batch "
                                                               "of Propose, then one of Verify); --no-group-rounds: "
                                                               "one loop per request"})
    speculative_model: str | None = field(default=None, metadata={"help": "DEPRECATED: use --speculative-config"})
    num_speculative_tokens: int | None = field(default=None, metadata={"help": "DEPRECATED: use --speculative-config"})


def resolve_speculative_config(cfg: ServeConfig) -> SpeculativeConfig | None:
    spec = legacy_speculative_config(cfg.speculative_config, cfg.speculative_model, cfg.num_speculative_tokens,
                                     flags=True)
    if spec:
        return SpeculativeConfig.from_any(spec)
    if cfg.model is None:
        default = default_speculative_config()
        if default is None:
            logger.warning("no embedded default draft is shipped: serving the target alone")
        return SpeculativeConfig.from_any(default)
    return None


@dataclass
class Stack:
    """The three running servers of ``specdec serve``."""

    target: object
    draft: object | None
    gateway: object

    def stop(self, grace: float = 5.0) -> None:
        for handle in (self.gateway, self.draft, self.target):
            if handle is not None:
                handle.stop(grace)


def check_security_files(cfg: ServeConfig) -> None:
    """Read the API key file and the TLS files, and check each certificate against its key (ConfigError)."""
    from specdec.serving.auth import ApiKeys
    from specdec.serving.tls import check_key_pair, server_credentials

    ApiKeys.load(cfg.api_key, cfg.api_key_file)
    server_credentials(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file)
    check_key_pair(cfg.ssl_certfile, cfg.ssl_keyfile, "--ssl-certfile", "--ssl-keyfile")


def start_stack(cfg: ServeConfig) -> Stack:
    from draft_service.config import DraftServiceConfig
    from draft_service.server import create_server as create_draft
    from gateway.config import GatewayConfig
    from gateway.server import create_server as create_gateway
    from target_service.config import TargetServiceConfig
    from target_service.server import create_server as create_target

    from specdec.serving.backend import cpu_threads
    from specdec.runner import set_num_threads
    from specdec.serving.batching import ComputeThread

    spec = resolve_speculative_config(cfg)
    check_security_files(cfg)  # before minutes of model loading, not after
    target_model = cfg.model or DEFAULT_TARGET
    max_len = min(x for x in (cfg.max_model_len, spec.max_model_len if spec else None, 10**9) if x)
    max_len = None if max_len == 10**9 else max_len
    common = dict(max_model_len=max_len, max_sequences=cfg.max_sequences, max_batch_size=cfg.max_batch_size)
    # Both models run their batches on ONE thread, taking turns (see specdec.serving.batching: two
    # multi-threaded OpenMP pools in one process slow both).
    threads = cpu_threads(cfg.num_threads)
    compute = ComputeThread("specdec-compute", thread_init=lambda: set_num_threads(threads))
    try:
        target = create_target(TargetServiceConfig(model=target_model, dtype=cfg.dtype, host="127.0.0.1", port=0,
                                                   num_threads=threads, **common), compute=compute)
    except BaseException:
        compute.close()
        raise
    target.on_stop.append(compute.close)
    draft = None
    try:
        if spec is not None:
            draft = create_draft(DraftServiceConfig(
                model=spec.model or "ngram", method=spec.method, prompt_lookup_max=spec.prompt_lookup_max,
                prompt_lookup_min=spec.prompt_lookup_min, revision=spec.revision, dtype=cfg.draft_dtype or cfg.dtype, host="127.0.0.1", port=0,
                num_threads=threads,
                draft_sample_method=spec.draft_sample_method, tli_proposals=spec.tli_proposals,
                target_tokenizer=target_model if spec.use_heterogeneous_vocab else None, **common), compute=compute)
        gateway = create_gateway(GatewayConfig(
            draft_addr=f"127.0.0.1:{draft.port}" if draft else None,
            target_addr=f"127.0.0.1:{target.port}",
            host=cfg.host, port=cfg.grpc_port, max_model_len=max_len,
            http_port=None if cfg.port < 0 else cfg.port, api_key=cfg.api_key, api_key_file=cfg.api_key_file,
            ssl_certfile=cfg.ssl_certfile, ssl_keyfile=cfg.ssl_keyfile, tls_cert_file=cfg.tls_cert_file,
            tls_key_file=cfg.tls_key_file, tls_client_ca_file=cfg.tls_client_ca_file,
            served_model_name=cfg.served_model_name or target_model,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 1,
            draft_sample_method=spec.draft_sample_method if spec else "greedy",
            use_heterogeneous_vocab=spec.use_heterogeneous_vocab if spec else False,
            metrics_port=cfg.metrics_port, log_requests=cfg.log_requests, group_rounds=cfg.group_rounds,
            disable_by_batch_size=spec.disable_by_batch_size if spec else None,
            adaptive_k=spec.adaptive_k if spec else False,
        ))
    except BaseException:
        for h in (draft, target):
            if h is not None:
                h.stop(0)
        raise
    return Stack(target, draft, gateway)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", nargs="?", default=None, help="target model (default: the embedded default pair)")
    settings.add_arguments(p, ServeConfig, ENV_PREFIX, skip=("model",))


def run(args: argparse.Namespace) -> int:
    import random

    import torch

    from specdec.serving.server import serve_until_signal

    cfg = settings.from_args(ServeConfig, args)
    cfg.model = args.target or settings.from_env(ServeConfig, ENV_PREFIX).model
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    stack = start_stack(cfg)
    logger.info("specdec serving: OpenAI %s on %s:%s, gateway gRPC%s on %s:%d (target on :%d, draft on %s)",
                "HTTPS" if cfg.ssl_certfile else "HTTP", cfg.host, stack.gateway.http_port,
                " (TLS)" if cfg.tls_cert_file else "", cfg.host, stack.gateway.port, stack.target.port,
                f":{stack.draft.port}" if stack.draft else "none")
    try:
        serve_until_signal(stack.gateway)
    finally:
        stack.stop()
    return 0
