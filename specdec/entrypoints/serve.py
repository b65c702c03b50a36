"""``specdec serve [TARGET] --speculative-config '{...}'``: draft, target and gateway on this machine.

Like ``vllm serve``. With no TARGET it serves the embedded default pair. The three parts are the
same servers the containers run alone (``specdec draft-service`` / ``target-service`` / ``gateway``),
started in one process here, the backends on loopback ports.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

from specdec.config import DEFAULT_TARGET, SpeculativeConfig, default_speculative_config, legacy_speculative_config
from specdec.entrypoints.serve_config import ServeConfig, part_configs
from specdec.serving import settings

logger = logging.getLogger(__name__)
ENV_PREFIX = "SPECDEC_SERVE"


__all__ = ["ServeConfig", "Stack", "resolve_speculative_config", "start_stack", "add_arguments", "run"]


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
    logger.warning("no --speculative-config: serving %s alone, speculation is off (give --speculative-config "
                   "'{\"method\": ..., \"num_speculative_tokens\": k}'; without a model, serve runs the embedded "
                   "default pair)", cfg.model)
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
    from gateway.config import https_settings
    from specdec.serving.auth import ApiKeys
    from specdec.serving.tls import server_credentials

    ApiKeys.load(cfg.api_key, cfg.api_key_file)
    server_credentials(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file)
    https_settings(cfg)


def start_stack(cfg: ServeConfig) -> Stack:
    import dataclasses

    from draft_service.server import create_server as create_draft
    from gateway.server import create_server as create_gateway
    from target_service.server import create_server as create_target

    from specdec.serving.backend import cpu_threads
    from specdec.engine.runner import set_num_threads
    from specdec.serving.batching import ComputeThread

    spec = resolve_speculative_config(cfg)
    check_security_files(cfg)  # before minutes of model loading, not after
    target_cfg, draft_cfg, gateway_cfg = part_configs(cfg, spec, cfg.model or DEFAULT_TARGET)
    # Both models run their batches on ONE thread, taking turns (see specdec.serving.batching: two
    # multi-threaded OpenMP pools in one process slow both).
    threads = cpu_threads(cfg.num_threads)
    compute = ComputeThread("specdec-compute", thread_init=lambda: set_num_threads(threads))
    try:
        target = create_target(dataclasses.replace(target_cfg, num_threads=threads), compute=compute)
    except BaseException:
        compute.close()
        raise
    target.on_stop.append(compute.close)
    draft = None
    try:
        if draft_cfg is not None:
            draft = create_draft(dataclasses.replace(draft_cfg, num_threads=threads), compute=compute)
        gateway = create_gateway(dataclasses.replace(
            gateway_cfg, draft_addr=f"{draft_cfg.host}:{draft.port}" if draft else None,
            target_addr=f"{target_cfg.host}:{target.port}"))
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

    from specdec.serving.allocator import return_freed_memory
    from specdec.serving.server import serve_until_signal

    return_freed_memory()  # before the models load (specdec.serving.allocator)
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
