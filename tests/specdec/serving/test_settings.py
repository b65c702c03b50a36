"""specdec.serving.settings: typed service configs from flags and SPECDEC_<SERVICE>_<FIELD> env vars."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from draft_service.config import ENV_PREFIX as DRAFT_PREFIX, DraftServiceConfig
from gateway.config import ENV_PREFIX as GATEWAY_PREFIX, GatewayConfig
from specdec.serving import settings
from specdec.entrypoints.serve import ENV_PREFIX as SERVE_PREFIX, ServeConfig
from target_service.config import ENV_PREFIX as TARGET_PREFIX, TargetServiceConfig

CONFIGS = [(DraftServiceConfig, DRAFT_PREFIX), (TargetServiceConfig, TARGET_PREFIX), (GatewayConfig, GATEWAY_PREFIX),
           (ServeConfig, SERVE_PREFIX)]


@pytest.fixture(autouse=True)
def no_specdec_env(monkeypatch):
    """Start every test from an environment without SPECDEC_* settings."""
    import os

    for name in list(os.environ):
        if name.startswith(("SPECDEC_DRAFT_", "SPECDEC_TARGET_", "SPECDEC_GATEWAY_", "SPECDEC_SERVE_")):
            monkeypatch.delenv(name)


def parse(cls, prefix, argv=()):
    parser = argparse.ArgumentParser(prog="test")
    settings.add_arguments(parser, cls, prefix)
    return settings.from_args(cls, parser.parse_args(list(argv)))


def test_env_prefixes_are_distinct_and_documented():
    assert [p for _, p in CONFIGS] == ["SPECDEC_DRAFT", "SPECDEC_TARGET", "SPECDEC_GATEWAY", "SPECDEC_SERVE"]
    assert settings.env_name("SPECDEC_DRAFT", "max_batch_size") == "SPECDEC_DRAFT_MAX_BATCH_SIZE"


@pytest.mark.parametrize(("cls", "prefix"), CONFIGS)
def test_defaults_without_flags_or_env_are_the_dataclass_defaults(cls, prefix):
    assert parse(cls, prefix) == cls()


@pytest.mark.parametrize(("cls", "prefix"), CONFIGS)
def test_every_field_is_a_flag_and_the_help_names_its_env_var(cls, prefix):
    parser = argparse.ArgumentParser(prog="test", formatter_class=lambda prog: argparse.HelpFormatter(prog, width=10**4))
    settings.add_arguments(parser, cls, prefix)
    options = {s for a in parser._actions for s in a.option_strings}
    help_text = parser.format_help()
    for f in dataclasses.fields(cls):
        assert "--" + f.name.replace("_", "-") in options
        assert settings.env_name(prefix, f.name) in help_text


def test_env_vars_set_typed_fields(monkeypatch):
    monkeypatch.setenv("SPECDEC_DRAFT_MAX_BATCH_SIZE", "7")
    monkeypatch.setenv("SPECDEC_DRAFT_SEQUENCE_TTL_SECONDS", "2.5")
    monkeypatch.setenv("SPECDEC_DRAFT_MAX_MODEL_LEN", "128")
    monkeypatch.setenv("SPECDEC_DRAFT_DRAFT_SAMPLE_METHOD", "probabilistic")
    monkeypatch.setenv("SPECDEC_DRAFT_TLI_PROPOSALS", "intersection")
    monkeypatch.setenv("SPECDEC_DRAFT_PORT", "6000")
    cfg = parse(DraftServiceConfig, DRAFT_PREFIX)
    assert cfg.max_batch_size == 7 and type(cfg.max_batch_size) is int
    assert cfg.sequence_ttl_seconds == 2.5 and type(cfg.sequence_ttl_seconds) is float
    assert cfg.max_model_len == 128 and cfg.port == 6000
    assert cfg.draft_sample_method == "probabilistic"
    assert cfg.tli_proposals == "intersection"
    # another service's prefix does not leak in
    assert parse(TargetServiceConfig, TARGET_PREFIX).max_batch_size == TargetServiceConfig().max_batch_size


def test_flag_beats_env_var(monkeypatch):
    monkeypatch.setenv("SPECDEC_DRAFT_MAX_BATCH_SIZE", "7")
    monkeypatch.setenv("SPECDEC_DRAFT_MODEL", "from-env")
    cfg = parse(DraftServiceConfig, DRAFT_PREFIX, ["--max-batch-size", "3"])
    assert cfg.max_batch_size == 3 and cfg.model == "from-env"
    cfg = parse(DraftServiceConfig, DRAFT_PREFIX, ["--model", "from-flag"])
    assert cfg.max_batch_size == 7 and cfg.model == "from-flag"


@pytest.mark.parametrize(("text", "value"), [
    ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("on", True), (" True ", True),
    ("false", False), ("0", False), ("no", False), ("off", False), ("False", False),
])
def test_bool_parsing(monkeypatch, text, value):
    monkeypatch.setenv("SPECDEC_GATEWAY_USE_HETEROGENEOUS_VOCAB", text)
    assert parse(GatewayConfig, GATEWAY_PREFIX).use_heterogeneous_vocab is value
    flag = "--use-heterogeneous-vocab" if value else "--no-use-heterogeneous-vocab"
    assert parse(GatewayConfig, GATEWAY_PREFIX, [flag]).use_heterogeneous_vocab is value


@pytest.mark.parametrize("text", ["none", "None", "null", ""])
def test_optional_fields_accept_none(monkeypatch, text):
    monkeypatch.setenv("SPECDEC_GATEWAY_DRAFT_ADDR", text)
    monkeypatch.setenv("SPECDEC_GATEWAY_MAX_MODEL_LEN", text)
    cfg = parse(GatewayConfig, GATEWAY_PREFIX)
    assert cfg.draft_addr is None and cfg.max_model_len is None
    cfg = parse(GatewayConfig, GATEWAY_PREFIX, ["--draft-addr", "10.0.0.1:1", "--max-model-len", "64"])
    assert cfg.draft_addr == "10.0.0.1:1" and cfg.max_model_len == 64


@pytest.mark.parametrize(("env", "value", "expected"), [
    ("SPECDEC_DRAFT_MAX_BATCH_SIZE", "abc", "expected int, got 'abc'"),
    ("SPECDEC_DRAFT_MAX_BATCH_SIZE", "none", "expected int, got 'none'"),  # not Optional
    ("SPECDEC_DRAFT_SEQUENCE_TTL_SECONDS", "ten", "expected float, got 'ten'"),
    ("SPECDEC_DRAFT_MAX_MODEL_LEN", "1.5", "expected int, got '1.5'"),
])
def test_bad_env_value_is_a_clear_error(monkeypatch, capsys, env, value, expected):
    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit) as info:
        parse(DraftServiceConfig, DRAFT_PREFIX)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert env in err and expected in err


def test_bad_bool_env_value_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_GATEWAY_USE_HETEROGENEOUS_VOCAB", "maybe")
    with pytest.raises(SystemExit):
        parse(GatewayConfig, GATEWAY_PREFIX)
    err = capsys.readouterr().err
    assert "SPECDEC_GATEWAY_USE_HETEROGENEOUS_VOCAB" in err and "boolean" in err and "'maybe'" in err


def test_bad_flag_value_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        parse(DraftServiceConfig, DRAFT_PREFIX, ["--max-batch-size", "lots"])
    err = capsys.readouterr().err
    assert "--max-batch-size" in err and "expected int, got 'lots'" in err


def test_from_env_with_overrides(monkeypatch):
    monkeypatch.setenv("SPECDEC_TARGET_MAX_SEQUENCES", "9")
    monkeypatch.setenv("SPECDEC_TARGET_DTYPE", "bfloat16")
    cfg = settings.from_env(TargetServiceConfig, TARGET_PREFIX, port=0, host="127.0.0.1")
    assert isinstance(cfg, TargetServiceConfig)
    assert (cfg.max_sequences, cfg.dtype, cfg.port, cfg.host) == (9, "bfloat16", 0, "127.0.0.1")


def test_cli_subcommands_parse_into_their_configs(monkeypatch):
    from specdec.entrypoints.cli import build_parser

    monkeypatch.setenv("SPECDEC_TARGET_MAX_BATCH_SIZE", "5")
    parser = build_parser()
    args = parser.parse_args(["target-service", "--port", "0", "--max-sequences", "4"])
    cfg = settings.from_args(TargetServiceConfig, args)
    assert (cfg.port, cfg.max_sequences, cfg.max_batch_size) == (0, 4, 5)
    args = parser.parse_args(["gateway", "--draft-addr", "none", "--num-speculative-tokens", "3"])
    cfg = settings.from_args(GatewayConfig, args)
    assert cfg.draft_addr is None and cfg.num_speculative_tokens == 3
    args = parser.parse_args(["serve", "my-target", "--speculative-config", '{"model": "d"}', "--grpc-port", "0"])
    assert args.target == "my-target" and settings.from_args(ServeConfig, args).speculative_config == '{"model": "d"}'


def test_help_survives_a_percent_sign_in_an_env_value(monkeypatch):
    """BUG: the env value is put into the argparse help verbatim; argparse %-formats help strings,
    so ``--help`` crashes when a value contains '%' (e.g. a path or URL-encoded address)."""
    monkeypatch.setenv("SPECDEC_GATEWAY_TOKENIZER", "/models/tok%20v2")
    parser = argparse.ArgumentParser(prog="test")
    settings.add_arguments(parser, GatewayConfig, GATEWAY_PREFIX)
    assert settings.from_args(GatewayConfig, parser.parse_args([])).tokenizer == "/models/tok%20v2"
    assert "SPECDEC_GATEWAY_TOKENIZER" in parser.format_help()


def test_boolean_flags_take_the_vllm_form():
    """--x sets a boolean, --no-x clears it, neither takes a value (vLLM), and the env var is the default."""
    import argparse
    import dataclasses

    from specdec.serving import settings

    @dataclasses.dataclass
    class Cfg:
        draft_fallback: bool = True
        use_heterogeneous_vocab: bool = False

    def parse(argv, env=None):
        import os

        old = dict(os.environ)
        os.environ.update(env or {})
        try:
            p = argparse.ArgumentParser()
            settings.add_arguments(p, Cfg, "SPECDEC_TEST")
            return settings.from_args(Cfg, p.parse_args(argv))
        finally:
            os.environ.clear()
            os.environ.update(old)

    assert parse([]) == Cfg(True, False)
    assert parse(["--no-draft-fallback", "--use-heterogeneous-vocab"]) == Cfg(False, True)
    assert parse(["--no-draft-fallback", "--draft-fallback", "--use-heterogeneous-vocab"]) == Cfg(True, True)
    with pytest.raises(SystemExit):  # `--x BOOL` is gone: no flag takes a value after it
        parse(["--draft-fallback", "false"])
    assert parse([], {"SPECDEC_TEST_DRAFT_FALLBACK": "false"}) == Cfg(False, False)
    assert parse(["--draft-fallback"], {"SPECDEC_TEST_DRAFT_FALLBACK": "false"}) == Cfg(True, False)


# --------------------------------------------------------------------------------------------------
# list fields (--api-key): repeated flags or comma-separated text; the flags replace the env var's list


def test_a_list_field_defaults_to_an_empty_list():
    assert parse(GatewayConfig, GATEWAY_PREFIX).api_key == []
    assert parse(ServeConfig, SERVE_PREFIX).api_key == []


def test_a_list_flag_may_be_repeated_or_comma_separated():
    cfg = parse(GatewayConfig, GATEWAY_PREFIX, ["--api-key", "k1", "--api-key", "k2, k3", "--port", "1"])
    assert cfg.api_key == ["k1", "k2", "k3"] and cfg.port == 1


@pytest.mark.parametrize(("text", "keys"), [("k1", ["k1"]), ("k1,k2", ["k1", "k2"]), (" k1 , ,k2 ", ["k1", "k2"]),
                                            ("", [])])
def test_a_list_env_var_is_comma_separated(monkeypatch, text, keys):
    monkeypatch.setenv("SPECDEC_GATEWAY_API_KEY", text)  # docker-compose sets it empty when unset
    assert parse(GatewayConfig, GATEWAY_PREFIX).api_key == keys


def test_list_flags_replace_the_env_var_list(monkeypatch):
    monkeypatch.setenv("SPECDEC_SERVE_API_KEY", "from-env-1,from-env-2")
    assert parse(ServeConfig, SERVE_PREFIX, ["--api-key", "a", "--api-key", "b"]).api_key == ["a", "b"]
    assert parse(ServeConfig, SERVE_PREFIX).api_key == ["from-env-1", "from-env-2"]


def test_a_secret_never_shows_in_help(monkeypatch):
    monkeypatch.setenv("SPECDEC_GATEWAY_API_KEY", "sk-very-secret")
    parser = argparse.ArgumentParser(prog="test", formatter_class=lambda prog: argparse.HelpFormatter(prog, width=10**4))
    settings.add_arguments(parser, GatewayConfig, GATEWAY_PREFIX)
    help_text = parser.format_help()
    assert "sk-very-secret" not in help_text and "SPECDEC_GATEWAY_API_KEY; default hidden" in help_text


@pytest.mark.parametrize(("cls", "prefix"), [(DraftServiceConfig, DRAFT_PREFIX), (TargetServiceConfig, TARGET_PREFIX),
                                             (GatewayConfig, GATEWAY_PREFIX), (ServeConfig, SERVE_PREFIX)])
def test_every_grpc_server_takes_the_tls_flags(monkeypatch, cls, prefix):
    monkeypatch.setenv(f"{prefix}_TLS_KEY_FILE", "/k.pem")
    cfg = parse(cls, prefix, ["--tls-cert-file", "/c.pem", "--tls-client-ca-file", "/ca.pem"])
    assert (cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file) == ("/c.pem", "/k.pem", "/ca.pem")


def test_gateway_backend_tls_and_https_flags(monkeypatch):
    monkeypatch.setenv("SPECDEC_GATEWAY_BACKEND_TLS_CA_FILE", "/ca.pem")
    cfg = parse(GatewayConfig, GATEWAY_PREFIX, ["--backend-tls-cert-file", "/c.pem", "--backend-tls-key-file", "/k.pem",
                                                "--ssl-certfile", "/s.pem", "--ssl-keyfile", "/s.key",
                                                "--api-key-file", "/keys"])
    assert (cfg.backend_tls_ca_file, cfg.backend_tls_cert_file, cfg.backend_tls_key_file) == ("/ca.pem", "/c.pem", "/k.pem")
    assert (cfg.ssl_certfile, cfg.ssl_keyfile, cfg.api_key_file) == ("/s.pem", "/s.key", "/keys")
    assert (cfg.ssl_ca_certs, cfg.ssl_cert_reqs) == (None, 0)


def test_gateway_https_client_certificate_flags(monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_GATEWAY_SSL_CERT_REQS", "2")
    cfg = parse(GatewayConfig, GATEWAY_PREFIX, ["--ssl-ca-certs", "/clients-ca.pem"])
    assert (cfg.ssl_ca_certs, cfg.ssl_cert_reqs) == ("/clients-ca.pem", 2)
    assert parse(GatewayConfig, GATEWAY_PREFIX, ["--ssl-cert-reqs", "1"]).ssl_cert_reqs == 1
    for bad in ("3", "required", "-1"):
        with pytest.raises(SystemExit):
            parse(GatewayConfig, GATEWAY_PREFIX, ["--ssl-cert-reqs", bad])
        assert "0 (none), 1 (optional) or 2 (required)" in capsys.readouterr().err


# -- the KV cache pool's settings (a size in bytes reads units) ------------------------------------------

@pytest.mark.parametrize(("text", "size"), [
    ("2GiB", 2 * 1024**3), ("512MiB", 512 * 1024**2), ("1e9", 10**9), ("1073741824", 2**30), ("1.5GB", 1_500_000_000),
    ("2Gi", 2 * 1024**3), ("64 KiB", 65536), ("3k", 3000), ("9007199254740993", 9007199254740993),
])
def test_kv_cache_memory_takes_byte_sizes(monkeypatch, text, size):
    from specdec.config import parse_byte_size

    assert parse_byte_size(text) == size
    monkeypatch.setenv("SPECDEC_TARGET_KV_CACHE_MEMORY", text)
    assert parse(TargetServiceConfig, TARGET_PREFIX).kv_cache_memory == size
    assert parse(DraftServiceConfig, DRAFT_PREFIX, ["--kv-cache-memory", text]).kv_cache_memory == size


@pytest.mark.parametrize("text", ["lots", "2XB", "0", "-1GiB", "1.5", "1e-3", "GiB", "nan"])
def test_a_bad_kv_cache_memory_is_a_clear_error(monkeypatch, capsys, text):
    from specdec.config import parse_byte_size

    with pytest.raises(ValueError, match="bytes"):
        parse_byte_size(text)
    monkeypatch.setenv("SPECDEC_TARGET_KV_CACHE_MEMORY", text)
    with pytest.raises(SystemExit):
        parse(TargetServiceConfig, TARGET_PREFIX)
    err = capsys.readouterr().err
    assert "SPECDEC_TARGET_KV_CACHE_MEMORY" in err and repr(text) in err and "bytes" in err
    with pytest.raises(SystemExit):
        parse(TargetServiceConfig, TARGET_PREFIX, ["--kv-cache-memory", text])
    assert "--kv-cache-memory" in capsys.readouterr().err


def test_the_kv_pool_settings_default_to_the_engines_and_read_their_env_vars(monkeypatch):
    from specdec.engine import kv_cache

    cfg = parse(TargetServiceConfig, TARGET_PREFIX)
    assert cfg.kv_cache_memory is None  # the engine's default: DEFAULT_KV_CACHE_MEMORY on CPU, a share of a GPU
    assert (cfg.block_size, cfg.enable_prefix_caching, cfg.gpu_memory_utilization) == (
        kv_cache.DEFAULT_BLOCK_SIZE, kv_cache.DEFAULT_ENABLE_PREFIX_CACHING, kv_cache.DEFAULT_GPU_MEMORY_UTILIZATION)
    monkeypatch.setenv("SPECDEC_DRAFT_BLOCK_SIZE", "32")
    monkeypatch.setenv("SPECDEC_DRAFT_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("SPECDEC_DRAFT_GPU_MEMORY_UTILIZATION", "0.5")
    cfg = parse(DraftServiceConfig, DRAFT_PREFIX)
    assert (cfg.block_size, cfg.enable_prefix_caching, cfg.gpu_memory_utilization) == (32, False, 0.5)
    assert parse(DraftServiceConfig, DRAFT_PREFIX, ["--enable-prefix-caching"]).enable_prefix_caching is True
    help_text = argparse.ArgumentParser()
    settings.add_arguments(help_text, TargetServiceConfig, TARGET_PREFIX)
    assert "--kv-cache-memory BYTES" in help_text.format_help()
