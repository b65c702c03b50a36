"""docker-compose.yml is valid and wires the three services (validated offline, no Docker engine)."""

import shutil
import subprocess
from pathlib import Path

import yaml

from tests.requirements import missing

ROOT = Path(__file__).resolve().parent.parent


def _compose() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        missing("docker-compose is not installed: apt-get install docker-compose")
    return exe


def test_compose_config_is_valid():
    result = subprocess.run([_compose(), "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_compose_wires_services_by_env():
    result = subprocess.run([_compose(), "-f", str(ROOT / "docker-compose.yml"), "config"],
                            capture_output=True, text=True, cwd=ROOT, check=True)
    cfg = yaml.safe_load(result.stdout)
    services = {k: v for k, v in cfg["services"].items() if k in ("draft", "target", "gateway")}
    assert set(cfg["services"]) == {"draft", "target", "gateway", "prometheus", "grafana"}
    gw_env = services["gateway"]["environment"]
    assert gw_env["SPECDEC_GATEWAY_DRAFT_ADDR"] == "draft:50051"
    assert gw_env["SPECDEC_GATEWAY_TARGET_ADDR"] == "target:50052"
    assert services["draft"]["environment"]["SPECDEC_DRAFT_PORT"] == "50051"
    assert services["target"]["environment"]["SPECDEC_TARGET_PORT"] == "50052"
    for name, svc in services.items():
        assert "specdec.entrypoints.healthcheck" in " ".join(svc["healthcheck"]["test"]), name
        assert any("/cache" in str(v) for v in svc.get("volumes", [])), f"{name} lacks the model cache volume"
    assert services["gateway"]["depends_on"]["draft"]["condition"] == "service_healthy"


def test_env_names_match_service_configs():
    """Every SPECDEC_* variable the compose file sets is a real config field of that service."""
    import dataclasses

    from draft_service.config import ENV_PREFIX as DP, DraftServiceConfig
    from gateway.config import ENV_PREFIX as GP, GatewayConfig
    from target_service.config import ENV_PREFIX as TP, TargetServiceConfig

    cfg = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    known = {
        "draft": {f"{DP}_{f.name.upper()}" for f in dataclasses.fields(DraftServiceConfig)},
        "target": {f"{TP}_{f.name.upper()}" for f in dataclasses.fields(TargetServiceConfig)},
        "gateway": {f"{GP}_{f.name.upper()}" for f in dataclasses.fields(GatewayConfig)},
    }
    for name, svc in cfg["services"].items():
        if name not in known:
            continue
        unknown = set(svc["environment"]) - known[name]
        assert not unknown, f"{name}: unknown variables {unknown}"


def test_prometheus_scrapes_every_service_and_grafana_gets_the_dashboards():
    """Prometheus' targets are the services' metrics ports as the compose file sets them; Grafana mounts
    the one copy of the dashboards (helm/specdec/dashboards) and a datasource pointing at Prometheus."""
    cfg = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = cfg["services"]
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {
        f"gateway:{services['gateway']['environment']['SPECDEC_GATEWAY_HTTP_PORT']}",
        f"draft:{services['draft']['environment']['SPECDEC_DRAFT_METRICS_PORT']}",
        f"target:{services['target']['environment']['SPECDEC_TARGET_METRICS_PORT']}",
    }
    assert any(v.startswith("./deploy/prometheus/prometheus.yml:") for v in services["prometheus"]["volumes"])
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert mounts["./helm/specdec/dashboards"] == "/var/lib/grafana/dashboards/specdec"
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/specdec.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards/specdec"
    source = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (ROOT / "helm/specdec/dashboards" / Path(home).name).exists()


def test_specdec_services_run_on_a_read_only_root_filesystem():
    """As the chart runs them (readOnlyRootFilesystem, an emptyDir on /tmp): a read-only root, a tmpfs on /tmp
    and the model cache on a volume; scripts/image-e2e.sh serves a completion from the stack run this way."""
    result = subprocess.run([_compose(), "-f", str(ROOT / "docker-compose.yml"), "config"],
                            capture_output=True, text=True, cwd=ROOT, check=True)
    services = yaml.safe_load(result.stdout)["services"]
    for name in ("draft", "target", "gateway"):
        svc = services[name]
        assert svc.get("read_only") is True, name
        assert "/tmp" in [str(t).split(":")[0] for t in svc.get("tmpfs", [])], name
        assert any(str(v).startswith("model-cache:/cache") for v in svc["volumes"]), name
    assert "readOnlyRootFilesystem: true" in (ROOT / "helm/specdec/values.yaml").read_text()
