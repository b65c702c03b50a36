"""``specdec serve``'s settings, made from the parts' settings so every default is defined once.

``specdec serve`` runs the target service, the draft service and the gateway in one process. Each of
their settings reaches it in exactly one of these ways (``tests/specdec/entrypoints/test_serve_flags.py``
fails when a new field is in none):

* the same flag: the backends' settings (``--max-batch-size``, ``--batch-wait-ms``, ...) go to both
  backends, the gateway's (``--max-concurrent-requests``, ``--api-key``, ...) to the gateway, the
  target's own (``--seeded-sampling``) and the draft's own (``--draft-top-n``) to that part;
* ``--draft-<name>`` for a backend setting the draft takes apart from the target (vLLM's
  ``--draft-*`` style; default: the target's value), e.g. ``--draft-dtype``, ``--draft-max-batch-size``;
* a key of ``--speculative-config`` (``num_speculative_tokens``, ``method``, ``prompt_lookup_max``, ...),
  as in vLLM;
* wired by ``serve`` itself (``WIRED``: the loopback addresses and ports, one ``/metrics``).

Two names differ, as in vLLM: ``--port`` is the HTTP port (the gateway's ``--http-port``) and
``--grpc-port`` the gateway's gRPC port (its ``--port``). Every flag reads ``SPECDEC_SERVE_<FIELD>``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from draft_service.config import DraftServiceConfig
from gateway.config import SPEC_KEYS as GATEWAY_SPEC_KEYS, GatewayConfig
from specdec.config import DEFAULT_HTTP_PORT, DRAFT_KEYS, FEATURE_METHODS, SpeculativeConfig
from specdec.serving.backend import DEFAULT_QUANTIZATION, BackendConfig
from target_service.config import TargetServiceConfig

LOOPBACK = "127.0.0.1"

# Backend settings both backends take from one flag, and that the draft may set apart (--draft-<name>).
DRAFT_OVERRIDABLE = ("dtype", "device", "max_sequences", "sequence_ttl_seconds", "max_batch_size", "batch_wait_ms",
                     "lean_forward", "kv_cache_memory", "block_size", "enable_prefix_caching", "gpu_memory_utilization",
                     "max_num_batched_tokens", "long_prefill_token_threshold", "max_num_partial_prefills")
# Backend settings with one value for both backends.
BACKEND_SHARED = ("revision", "max_model_len", "num_threads", "kernels")  # revision: the target's (the draft's is a spec key)
# Draft-service settings that are flags of serve under the same name.
DRAFT_SAME = ("draft_top_n",)
# Target-service settings that are flags of serve under the same name.
TARGET_SAME = ("seeded_sampling", "batch_invariant",  # the target's: the draft's numerics never change the output
               "quantization",  # the target's --quantization; the draft's is speculative_config's "quantization"
               "tree_tile_rows")
# Gateway settings under another name in serve (vLLM's: --port is HTTP).
GATEWAY_RENAMED = {"port": "grpc_port", "http_port": "port"}
# part -> field -> the speculative_config key that sets it.
SPEC_KEYS: dict[str, dict[str, str]] = {
    "draft": {"model": "model", "method": "method", "draft_sample_method": "draft_sample_method",
              "tli_proposals": "tli_proposals", "prompt_lookup_max": "prompt_lookup_max",
              "prompt_lookup_min": "prompt_lookup_min", "max_model_len": "max_model_len", "revision": "revision",
              "target_tokenizer": "use_heterogeneous_vocab", "target_model": "method", "quantization": "quantization",
              "draft_model_num_speculative_tokens": "draft_model_num_speculative_tokens",
              **{key: key for key in DRAFT_KEYS}},
    "gateway": GATEWAY_SPEC_KEYS,
    "target": {"max_model_len": "max_model_len"},
}
# part -> field -> why serve sets it itself.
_LOOPBACK = "serve runs the backends on loopback ports of its own process"
_PLAIN = "the loopback hops inside one process are plaintext"
_ONE_METRICS = "one process, one /metrics (on the HTTP port, or serve's --metrics-port)"
_ONE_DRAIN = "serve drains through its gateway (--drain-grace-seconds), then stops its loopback backends"
WIRED: dict[str, dict[str, str]] = {
    "target": {"model": "the positional TARGET", "host": _LOOPBACK, "port": _LOOPBACK, "metrics_port": _ONE_METRICS,
               "tls_cert_file": _PLAIN, "tls_key_file": _PLAIN, "tls_client_ca_file": _PLAIN,
               "drain_grace_seconds": _ONE_DRAIN},
    "draft": {"host": _LOOPBACK, "port": _LOOPBACK, "metrics_port": _ONE_METRICS, "tls_cert_file": _PLAIN,
              "tls_key_file": _PLAIN, "tls_client_ca_file": _PLAIN, "drain_grace_seconds": _ONE_DRAIN,
              "batch_invariant": "off: the draft's numerics never change the output (--batch-invariant is the target's)"},
    "gateway": {"speculative_config": "serve reads --speculative-config once and gives each part its keys",
                "draft_addr": _LOOPBACK, "target_addr": _LOOPBACK, "backend_tls_ca_file": _PLAIN,
                "backend_tls_cert_file": _PLAIN, "backend_tls_key_file": _PLAIN, "backend_tls_server_name": _PLAIN},
}
PARTS: dict[str, type] = {"target": TargetServiceConfig, "draft": DraftServiceConfig, "gateway": GatewayConfig}


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _copy(cls: type, name: str, new_name: str | None = None, *, optional: bool = False, help_text: str | None = None,
          default: Any = dataclasses.MISSING) -> tuple[str, Any, dataclasses.Field]:
    """One field of ``cls`` as a make_dataclass entry, with its default (the one definition) unless given."""
    f = _fields(cls)[name]
    tp = typing.get_type_hints(cls)[name]
    metadata = dict(f.metadata)
    if help_text is not None:
        metadata["help"] = help_text
    if optional:
        return new_name or name, tp | None, field(default=None, metadata=metadata)
    if default is not dataclasses.MISSING:
        return new_name or name, tp, field(default=default, metadata=metadata)
    if f.default_factory is not dataclasses.MISSING:
        return new_name or name, tp, field(default_factory=f.default_factory, metadata=metadata)
    return new_name or name, tp, field(default=f.default, metadata=metadata)


def gateway_same_fields() -> list[str]:
    """The gateway's settings serve takes under the same name."""
    taken = set(WIRED["gateway"]) | set(SPEC_KEYS["gateway"]) | set(GATEWAY_RENAMED)
    return [n for n in _fields(GatewayConfig) if n not in taken]


@dataclass
class _ServeOwn:
    model: str | None = field(default=None, metadata={"help": "target model (positional TARGET; default: the "
                                                               "embedded default pair)"})
    speculative_config: str | None = field(default=None, metadata={
        "help": "JSON: {\"method\": \"draft_model\", \"model\": DRAFT, \"num_speculative_tokens\": k, ...}; "
                f"keys: {SpeculativeConfig.valid_keys()}"})
    seed: int = field(default=0, metadata={"help": "global random seed (requests without a seed)"})
    speculative_model: str | None = field(default=None, metadata={"help": "DEPRECATED: use --speculative-config"})
    num_speculative_tokens: int | None = field(default=None, metadata={"help": "DEPRECATED: use --speculative-config"})


def _serve_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    own = [(f.name, typing.get_type_hints(_ServeOwn)[f.name], f) for f in dataclasses.fields(_ServeOwn)]
    out = own[:2]
    out.append(_copy(GatewayConfig, "host", help_text="address the gateway binds (HTTP and gRPC)"))
    out.append(_copy(GatewayConfig, "http_port", "port", default=DEFAULT_HTTP_PORT,
                     help_text="OpenAI-compatible HTTP port (-1 or none: no HTTP; 0: any free port)"))
    out.append(_copy(GatewayConfig, "port", "grpc_port", help_text="the gateway's GenerationService gRPC port"))
    out.append(own[2])
    for name in DRAFT_OVERRIDABLE:
        out.append(_copy(BackendConfig, name, help_text=f"target and draft: {_fields(BackendConfig)[name].metadata['help']}"))
    for name in BACKEND_SHARED:
        out.append(_copy(BackendConfig, name))
    for name in DRAFT_OVERRIDABLE:
        out.append(_copy(BackendConfig, name, f"draft_{name}", optional=True,
                         help_text=f"the draft's --{name.replace('_', '-')} (default: the target's)"))
    for name in DRAFT_SAME:
        out.append(_copy(DraftServiceConfig, name))
    for name in TARGET_SAME:
        out.append(_copy(TargetServiceConfig, name))
    for name in gateway_same_fields():
        if name not in ("host", "max_model_len"):  # host above; max_model_len is the backends' too
            out.append(_copy(GatewayConfig, name))
    return out + own[3:]


ServeConfig = dataclasses.make_dataclass("ServeConfig", _serve_fields())
ServeConfig.__module__ = __name__
ServeConfig.__doc__ = "Settings of ``specdec serve`` (see this module's docstring for where each comes from)."


def part_configs(cfg: Any, spec: SpeculativeConfig | None, target_model: str,
                 ) -> tuple[TargetServiceConfig, DraftServiceConfig | None, GatewayConfig]:
    """The three parts' configs ``specdec serve`` runs (loopback backends on any free port; the gateway's
    draft_addr/target_addr are filled in once they listen)."""
    max_len = min((x for x in (cfg.max_model_len, spec.max_model_len if spec else None) if x), default=None)

    def backend(cls: type, draft: bool, **kw: Any):
        values = {n: getattr(cfg, n) for n in BACKEND_SHARED}
        for n in DRAFT_OVERRIDABLE:
            own = getattr(cfg, f"draft_{n}") if draft else None
            values[n] = own if own is not None else getattr(cfg, n)
        values.update(max_model_len=max_len, host=LOOPBACK, port=0, **kw)
        return cls(**values)

    target = backend(TargetServiceConfig, False, model=target_model, **{n: getattr(cfg, n) for n in TARGET_SAME})
    draft = None
    if spec is not None:
        draft = backend(DraftServiceConfig, True, model=spec.model or spec.method, method=spec.method,
                        revision=spec.revision, prompt_lookup_max=spec.prompt_lookup_max,
                        prompt_lookup_min=spec.prompt_lookup_min, draft_sample_method=spec.draft_sample_method,
                        tli_proposals=spec.tli_proposals, quantization=spec.quantization or DEFAULT_QUANTIZATION,
                        target_tokenizer=target_model if spec.use_heterogeneous_vocab else None,
                        target_model=target_model if spec.method in FEATURE_METHODS else None,
                        **{key: getattr(spec, key) for key in DRAFT_KEYS},
                        draft_model_num_speculative_tokens=spec.draft_model_num_speculative_tokens,
                        **{n: getattr(cfg, n) for n in DRAFT_SAME})
    gateway_values = {n: getattr(cfg, n) for n in gateway_same_fields()}
    gateway_values.update(
        draft_addr=None, max_model_len=max_len, port=cfg.grpc_port, http_port=None if cfg.port is None or cfg.port < 0 else cfg.port,
        served_model_name=cfg.served_model_name or target_model)
    if spec is not None:
        gateway_values.update({n: getattr(spec, key) for n, key in SPEC_KEYS["gateway"].items() if n != "max_model_len"})
    return target, draft, GatewayConfig(**gateway_values)
