"""Defaults live once: docker-compose.yml and the Helm chart's default values run what ``specdec serve`` with
no arguments runs (the embedded default pair, each part with its code default), and the Dockerfile
exposes the ports they use. Each SPECDEC_* variable the compose file or the rendered chart sets is parsed
by the part's own CLI parser and compared with the config ``serve`` builds for that part; what only a
deployment decides (addresses, ports, metrics ports, threads from the CPU limit, the API key) is named."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from specdec.config import DEFAULT_TARGET
from specdec.entrypoints import serve
from specdec.entrypoints.serve_config import DEFAULT_HTTP_PORT, PARTS, ServeConfig, part_configs
from specdec.serving import settings

ROOT = Path(__file__).resolve().parent
ROOT = ROOT.parent
PREFIX = {"target": "SPECDEC_TARGET", "draft": "SPECDEC_DRAFT", "gateway": "SPECDEC_GATEWAY"}
# Set by a deployment, not a default: where things listen and how they find each other, the key, the
# metrics ports (serve has one /metrics), and the chart's threads (the CPU limit's whole cores).
DEPLOYMENT = {"draft_addr", "target_addr", "metrics_port", "api_key", "num_threads"}


def _serve_parts() -> dict[str, object]:
    """The three configs `specdec serve` with no arguments runs, with the containers' ports."""
    cfg = ServeConfig()
    parts = dict(zip(PARTS, part_configs(cfg, serve.resolve_speculative_config(cfg), DEFAULT_TARGET)))
    parts["target"] = dataclasses.replace(parts["target"], port=PARTS["target"]().port, host="0.0.0.0")
    parts["draft"] = dataclasses.replace(parts["draft"], port=PARTS["draft"]().port, host="0.0.0.0")
    return parts


def _parse(role: str, env: dict[str, str], monkeypatch) -> object:
    import os

    for name in [n for n in os.environ if n.startswith("SPECDEC_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, PARTS[role], PREFIX[role])
    return settings.from_args(PARTS[role], parser.parse_args([]))


def _check(role: str, env: dict[str, str], monkeypatch, where: str) -> list[str]:
    expected, parsed = _serve_parts()[role], _parse(role, env, monkeypatch)
    checked = []
    for name in env:
        if not name.startswith(PREFIX[role] + "_"):
            continue
        field = name.removeprefix(PREFIX[role] + "_").lower()
        if field in DEPLOYMENT:
            continue
        want = getattr(expected, field)
        assert getattr(parsed, field) == want, f"{where}: {name}={env[name]!r}, but `specdec serve` runs {want!r}"
        checked.append(field)
    return checked


def _compose_env(text: str) -> str:
    """docker-compose's `${VAR:-default}` with VAR unset."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", text)


@pytest.mark.parametrize("role", PARTS)
def test_compose_runs_what_serve_runs(role, monkeypatch):
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    env = {k: _compose_env(str(v)) for k, v in compose[role]["environment"].items()}
    checked = _check(role, env, monkeypatch, f"docker-compose.yml {role}")
    assert "port" in checked
    if role == "gateway":
        assert {"http_port", "num_speculative_tokens"} <= set(checked)
    if role == "draft":
        assert {"model", "method", "draft_model_num_speculative_tokens", "suffix_decoding_max_spec_factor"} <= set(checked)
    if role in ("draft", "target"):  # the KV cache pool's knobs, each the code's default unless overridden
        assert {"kv_cache_memory", "block_size", "enable_prefix_caching", "gpu_memory_utilization"} <= set(checked)


def test_compose_restates_only_what_it_must():
    """The compose file sets no variable that equals the code's default for that part, except the knobs
    users override (`${VAR:-default}`) and what the parts' defaults do not give (the pair's speculation)."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for role in PARTS:
        default = PARTS[role]()
        for name, value in compose[role]["environment"].items():
            field = name.removeprefix(PREFIX[role] + "_").lower()
            if "${" in str(value) or field in DEPLOYMENT or field == "port":
                continue
            assert str(getattr(default, field)) != str(value), f"{role}: {name} restates the code's default"


def test_chart_runs_what_serve_runs(monkeypatch):
    from tests.helm.test_chart import by_component, container, env_of

    deployments = by_component({}, "Deployment")
    for role in PARTS:
        c = container(deployments[role])
        assert c["args"][0] == {"gateway": "gateway"}.get(role, f"{role}-service")
        env = {k: v for k, v in env_of(c).items() if not v.startswith("secret:")}
        checked = _check(role, env, monkeypatch, f"the chart's {role}")
        assert "port" in checked, role
    values = yaml.safe_load((ROOT / "helm/specdec/values.yaml").read_text())
    assert values["gateway"]["httpPort"] == ServeConfig().port == DEFAULT_HTTP_PORT
    assert values["gateway"]["grpcPort"] == ServeConfig().grpc_port


def test_dockerfile_exposes_the_ports_and_serves_by_default():
    text = (ROOT / "Dockerfile").read_text()
    exposed = {int(p) for line in text.splitlines() if line.startswith("EXPOSE") for p in line.split()[1:]}
    parts = {role: cls() for role, cls in PARTS.items()}
    assert {DEFAULT_HTTP_PORT, parts["gateway"].port, parts["draft"].port, parts["target"].port} <= exposed
    assert 'ENTRYPOINT ["specdec"]' in text and 'CMD ["serve"]' in text
