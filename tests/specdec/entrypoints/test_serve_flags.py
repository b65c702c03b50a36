"""``specdec serve`` takes every setting of the parts it runs (parse level, no model loaded): each field of
the target service's, the draft service's and the gateway's config is a serve flag of the same name, a
``--draft-<name>`` flag, a ``--speculative-config`` key, or wired by serve itself, and a value given to
serve reaches the part's config. A field added to a part without a decision here fails."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing

import pytest

from specdec.config import SpeculativeConfig
from specdec.entrypoints import serve, serve_config
from specdec.entrypoints.serve_config import (BACKEND_SHARED, DRAFT_OVERRIDABLE, DRAFT_SAME, GATEWAY_RENAMED, PARTS,
                                              SPEC_KEYS, TARGET_SAME, WIRED, ServeConfig, gateway_same_fields,
                                              part_configs)
from specdec.serving import settings
from specdec.serving.backend import BackendConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec serve", exit_on_error=False)
    serve.add_arguments(p)
    return p


def _serve(argv: list[str]):
    args = _parser().parse_args(argv)
    cfg = settings.from_args(ServeConfig, args)
    cfg.model = args.target
    return cfg, serve.resolve_speculative_config(cfg)


def _serve_flag(role: str, name: str) -> str | None:
    """The serve field a part's field is set by (None: a speculative_config key or wired)."""
    if name in WIRED[role] or name in SPEC_KEYS[role]:
        return None
    if role == "gateway":
        return GATEWAY_RENAMED.get(name, name)
    if name in DRAFT_OVERRIDABLE or name in BACKEND_SHARED or (role == "draft" and name in DRAFT_SAME) or (
            role == "target" and name in TARGET_SAME):
        return name
    raise AssertionError(f"{role}.{name}: no way through `specdec serve` (add it to serve_config)")


@pytest.mark.parametrize("role", PARTS)
def test_every_field_of_every_part_reaches_serve_one_way(role):
    serve_fields = {f.name for f in dataclasses.fields(ServeConfig)}
    for name in (f.name for f in dataclasses.fields(PARTS[role])):
        ways = [name in WIRED[role], name in SPEC_KEYS[role], _serve_flag(role, name) is not None]
        if name == "max_model_len":  # a flag and a speculative_config key (serve takes the smaller)
            assert name in serve_fields
            continue
        assert sum(ways) == 1, f"{role}.{name}: {ways}"
        flag = _serve_flag(role, name)
        if flag is not None:
            assert flag in serve_fields, f"{role}.{name}"
    for role_keys in SPEC_KEYS.values():
        assert set(role_keys.values()) <= set(SpeculativeConfig.valid_keys())
    assert {f"draft_{n}" for n in DRAFT_OVERRIDABLE} <= serve_fields


def _other_value(tp, default):
    """A valid flag text differing from ``default``, and the value it parses to."""
    base, _ = settings._base_type(tp)
    if settings._list_item_type(tp) is not None:
        return ["--{flag}", "k-1"], ["k-1"]
    if base is bool:
        return (["--no-{flag}"], False) if default else (["--{flag}"], True)
    if base is int:
        value = 7 if default != 7 else 8
    elif base is float:
        value = 7.5
    else:
        value = "bfloat16" if default != "bfloat16" else "float32"
    return ["--{flag}", str(value)], value


# Settings that take a few numbers only: a valid value other than the default.
NOT_ANY_INT = {"ssl_cert_reqs": 2}


@pytest.mark.parametrize("role", PARTS)
def test_a_value_given_to_serve_reaches_the_part(role):
    hints = typing.get_type_hints(PARTS[role])
    defaults = part_configs(ServeConfig(), SpeculativeConfig(model="d"), "t")
    base = dict(zip(PARTS, defaults))[role]
    for name in (f.name for f in dataclasses.fields(PARTS[role])):
        flag = _serve_flag(role, name) if name not in WIRED[role] else None
        if flag is None:
            continue
        if name in NOT_ANY_INT:
            argv, value = ["--{flag}", str(NOT_ANY_INT[name])], NOT_ANY_INT[name]
        else:
            argv, value = _other_value(hints[name], getattr(base, name))
        if role == "draft" and name in DRAFT_OVERRIDABLE:
            flag = f"draft_{name}"
        argv = [a.format(flag=flag.replace("_", "-")) for a in argv]
        cfg, _ = _serve(["t", "--speculative-config", '{"model": "d"}', *argv])
        configs = dict(zip(PARTS, part_configs(cfg, SpeculativeConfig(model="d"), "t")))
        assert getattr(configs[role], name) == value, (role, name, argv)
        if role == "draft" and name in DRAFT_OVERRIDABLE:  # --draft-x leaves the target's x alone
            assert getattr(configs["target"], name) == getattr(defaults[0], name), name
        if role == "target" and name in DRAFT_OVERRIDABLE:  # --x reaches the draft too, unless --draft-x
            assert getattr(configs["draft"], name) == value, name


def test_speculative_config_keys_reach_the_parts():
    spec = {"method": "draft_model", "model": "d", "num_speculative_tokens": 5, "draft_sample_method": "probabilistic",
            "use_heterogeneous_vocab": True, "tli_proposals": "intersection", "max_model_len": 99, "revision": "r1",
            "prompt_lookup_max": 5, "prompt_lookup_min": 3, "disable_by_batch_size": 4, "adaptive_k": True,
            "overlap": True, "quantization": "none", "suffix_decoding_max_tree_depth": 12,
            "suffix_decoding_max_cached_requests": 7, "suffix_decoding_max_spec_factor": 2.5,
            "suffix_decoding_min_token_prob": 0.25, "draft_model_num_speculative_tokens": 2,
            "enable_suffix_decoding": False,  # (method eagle3's: below)
            "suffix_decoding_min_score": 1.5, "suffix_decoding_merge_score": 4.0,
            # (trees need one vocabulary: unset beside use_heterogeneous_vocab; the tree test below sets it)
            "speculative_token_tree": None, "speculative_eagle_topk": 3, "speculative_num_draft_tokens": 9}
    assert set(spec) == set(SpeculativeConfig.valid_keys())
    cfg, resolved = _serve(["t", "--speculative-config", json.dumps(spec), "--max-model-len", "120"])
    target, draft, gateway = part_configs(cfg, resolved, "t")
    for role, config in (("draft", draft), ("gateway", gateway), ("target", target)):
        for name, key in SPEC_KEYS[role].items():
            if name == "target_tokenizer":
                assert draft.target_tokenizer == "t"
            elif name == "target_model":  # only an EAGLE-3 head reads the target (below)
                assert draft.target_model is None
            elif name == "max_model_len":
                assert config.max_model_len == 99  # the smaller of the key and --max-model-len
            else:
                assert getattr(config, name) == spec[key], (role, name)
    eagle = {"method": "eagle3", "model": "h", "enable_suffix_decoding": True, "draft_model_num_speculative_tokens": 3,
             "num_speculative_tokens": 15}
    cfg, resolved = _serve(["t", "--speculative-config", json.dumps(eagle)])
    _, draft, _ = part_configs(cfg, resolved, "t")
    assert (draft.method, draft.enable_suffix_decoding, draft.target_model,
            draft.draft_model_num_speculative_tokens) == ("eagle3", True, "t", 3)


def test_serve_flags_read_serve_env_vars(monkeypatch):
    monkeypatch.setenv("SPECDEC_SERVE_BATCH_WAIT_MS", "3")
    monkeypatch.setenv("SPECDEC_SERVE_DRAFT_MAX_BATCH_SIZE", "5")
    monkeypatch.setenv("SPECDEC_SERVE_DRAFT_FALLBACK", "false")
    cfg, spec = _serve(["t", "--speculative-config", '{"model": "d"}', "--sequence-ttl-seconds", "30"])
    target, draft, gateway = part_configs(cfg, spec, "t")
    assert target.batch_wait_ms == draft.batch_wait_ms == 3.0
    assert (draft.max_batch_size, target.max_batch_size) == (5, BackendConfig().max_batch_size)
    assert target.sequence_ttl_seconds == draft.sequence_ttl_seconds == 30.0
    assert gateway.draft_fallback is False


def test_serve_defaults_are_the_parts_defaults():
    """No default is restated: every field serve shares with a part has the part's default."""
    serve_defaults = ServeConfig()
    for name in (*DRAFT_OVERRIDABLE, *BACKEND_SHARED):
        assert getattr(serve_defaults, name) == getattr(BackendConfig(), name), name
        if name in DRAFT_OVERRIDABLE:
            assert getattr(serve_defaults, f"draft_{name}") is None  # the target's value
    gateway_defaults = PARTS["gateway"]()
    for name in gateway_same_fields():
        assert getattr(serve_defaults, name) == getattr(gateway_defaults, name), name
    assert serve_defaults.grpc_port == gateway_defaults.port
    assert serve_defaults.port == serve_config.DEFAULT_HTTP_PORT
    # serve with no arguments: the parts run with their defaults, but for the embedded pair's speculation
    target, draft, gateway = part_configs(ServeConfig(), serve.resolve_speculative_config(ServeConfig()), "t")
    for role, config in (("target", target), ("draft", draft), ("gateway", gateway)):
        default = PARTS[role]()
        for f in dataclasses.fields(config):
            if f.name in WIRED[role] or f.name in SPEC_KEYS[role] or f.name in GATEWAY_RENAMED:
                continue
            if role == "gateway" and f.name == "served_model_name":
                continue  # the target's name, as the gateway alone answers
            assert getattr(config, f.name) == getattr(default, f.name), (role, f.name)


def test_no_flag_of_any_command_takes_a_boolean_value():
    """vLLM's booleans everywhere: --x / --no-x, never `--x true`."""
    from specdec.entrypoints import cli

    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if any(s.startswith("--no-") for s in action.option_strings):
                assert action.nargs == 0, (name, action.option_strings)
            assert action.metavar != "BOOL", (name, action.option_strings)


def test_an_eagle3_head_is_given_the_target():
    cfg, resolved = _serve(["t", "--speculative-config", json.dumps({"method": "eagle3", "model": "h"})])
    _, draft, gateway = part_configs(cfg, resolved, "t")
    assert (draft.method, draft.model, draft.target_model, draft.target_tokenizer) == ("eagle3", "h", "t", None)


def test_parts_take_the_speculative_config_defaults():
    """A part's setting that a speculative_config key sets defaults to that key's default (one definition)."""
    spec_defaults = SpeculativeConfig.__dataclass_fields__
    for role, keys in SPEC_KEYS.items():
        default = PARTS[role]()
        for name, key in keys.items():
            if name in ("model", "target_tokenizer", "target_model", "max_model_len", "revision"):
                continue  # the model names are the default pair's; the rest: "the model's" / none on both sides
            assert getattr(default, name) == spec_defaults[key].default, (role, name)


def test_kv_cache_flags_reach_both_backends_and_the_draft_may_differ(monkeypatch):
    """--kv-cache-memory (byte sizes: 2GiB), --block-size, --enable-prefix-caching and --gpu-memory-utilization
    set target and draft; --draft-<flag> the draft apart; SPECDEC_SERVE_* work as well."""
    cfg, spec = _serve(["t", "--speculative-config", '{"model": "d"}', "--kv-cache-memory", "2GiB", "--block-size", "32",
                        "--gpu-memory-utilization", "0.8", "--draft-kv-cache-memory", "256MiB",
                        "--no-draft-enable-prefix-caching"])
    target, draft, _ = part_configs(cfg, spec, "t")
    assert (target.kv_cache_memory, draft.kv_cache_memory) == (2 * 1024**3, 256 * 1024**2)
    assert target.block_size == draft.block_size == 32
    assert target.gpu_memory_utilization == draft.gpu_memory_utilization == 0.8
    assert (target.enable_prefix_caching, draft.enable_prefix_caching) == (True, False)
    monkeypatch.setenv("SPECDEC_SERVE_KV_CACHE_MEMORY", "1e9")
    monkeypatch.setenv("SPECDEC_SERVE_ENABLE_PREFIX_CACHING", "false")
    cfg, spec = _serve(["t", "--speculative-config", '{"model": "d"}'])
    target, draft, _ = part_configs(cfg, spec, "t")
    assert target.kv_cache_memory == draft.kv_cache_memory == 10**9
    assert target.enable_prefix_caching is draft.enable_prefix_caching is False


def test_token_tree_keys_reach_the_draft():
    spec = {"method": "suffix", "model": "d", "num_speculative_tokens": 8, "speculative_token_tree": "dynamic",
            "speculative_eagle_topk": 3, "speculative_num_draft_tokens": 9}
    cfg, resolved = _serve(["t", "--speculative-config", json.dumps(spec)])
    _, draft, _ = part_configs(cfg, resolved, "t")
    assert (draft.speculative_token_tree, draft.speculative_eagle_topk, draft.speculative_num_draft_tokens) == \
        ("dynamic", 3, 9)
