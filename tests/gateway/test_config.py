"""The gateway's settings (gateway.config): ``--speculative-config``, the JSON ``specdec serve`` takes, sets the
gateway's round keys; a flag that disagrees with it is refused; a served gateway runs the config's k."""

from __future__ import annotations

import json

import pytest

from gateway.config import GatewayConfig, with_speculative_config
from specdec.entrypoints.cli import build_parser
from specdec.errors import ConfigError

PAIR = {"method": "suffix", "model": "smollm2-135m-draft", "num_speculative_tokens": 15,
        "draft_model_num_speculative_tokens": 1, "disable_by_batch_size": 3, "speculative_token_tree": "dynamic"}


def test_the_gateway_takes_its_keys_of_the_config():
    cfg = with_speculative_config(GatewayConfig(speculative_config=json.dumps({**PAIR, "adaptive_k": True})))
    assert (cfg.num_speculative_tokens, cfg.disable_by_batch_size, cfg.adaptive_k) == (15, 3, True)
    assert cfg.max_model_len is None and not cfg.overlap
    suffix = with_speculative_config(GatewayConfig(speculative_config='{"method": "suffix"}'))
    assert suffix.num_speculative_tokens == 24  # the config's own default for suffix, as serve resolves it
    shorter = with_speculative_config(GatewayConfig(max_model_len=512, speculative_config=json.dumps(
        {"model": "d", "max_model_len": 256})))
    assert shorter.max_model_len == 256
    assert with_speculative_config(GatewayConfig()) == GatewayConfig()


@pytest.mark.parametrize("config, match", [
    (GatewayConfig(num_speculative_tokens=4, speculative_config=json.dumps(PAIR)), "disagree"),
    (GatewayConfig(speculative_config='{"model": "d", "num_spec_tokens": 3}'), "unknown speculative_config key"),
    (GatewayConfig(speculative_config="{nope"), "not valid JSON"),
])
def test_bad_or_conflicting_configs_are_refused(config, match):
    with pytest.raises(ConfigError, match=match):
        with_speculative_config(config)


def test_the_flag_and_its_variable(monkeypatch):
    args = build_parser().parse_args(["gateway", "--speculative-config", json.dumps(PAIR)])
    assert json.loads(args.speculative_config) == PAIR
    monkeypatch.setenv("SPECDEC_GATEWAY_SPECULATIVE_CONFIG", '{"method": "ngram"}')
    assert build_parser().parse_args(["gateway"]).speculative_config == '{"method": "ngram"}'


def test_a_served_gateway_runs_the_configs_k(servers, target_dir, good_draft_dir):
    target, draft = servers.target(target_dir), servers.draft(good_draft_dir)
    handle = servers.gateway(target, draft, speculative_config=json.dumps(
        {"model": str(good_draft_dir), "num_speculative_tokens": 5, "adaptive_k": False}))
    assert handle.backend.config.num_speculative_tokens == 5
