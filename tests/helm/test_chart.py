"""The Helm chart (helm/specdec), rendered offline: helm's own engine through helm-python-sdk (no helm
binary, no cluster), every object checked against the Kubernetes OpenAPI schemas of several releases
(kubernetes-validate, strict), and the wiring checked on the rendered objects: Services select their
role's pods, the gateway dials the backends' Services and ports, probes hit container ports, and every
SPECDEC_* variable is one the `specdec` CLI reads (the containers' env and args are parsed by the CLI's
own parser). Nothing here proves the chart runs on a cluster: none is available to the tests.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from tests.requirements import missing

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "specdec"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
RELEASE, NAMESPACE = "demo", "llm"
# kubernetes-validate 1.37.0 knows 1.25-1.37; the chart says kubeVersion >= 1.27 (native gRPC probes).
KUBE_VERSIONS = ("1.30.0", "1.34.0", "1.37.0")
CRDS = {"ServiceMonitor", "Certificate"}  # not in Kubernetes' schemas: checked by hand below
INSTALL = "pip install helm-python-sdk==0.2.2 kubernetes-validate==1.37.0"
API_KEY = "sk-chart-test"


def _helm():
    try:
        import helm_python
    except ImportError:
        missing(f"helm-python-sdk is not installed: {INSTALL}")
    return helm_python


def _kubernetes_validate():
    try:
        import kubernetes_validate
    except ImportError:
        missing(f"kubernetes-validate is not installed: {INSTALL}")
    return kubernetes_validate


def merge(*layers: dict) -> dict:
    """Deep merge of values, later layers winning (as `helm -f a -f b`)."""
    out: dict = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merge(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
    return out


def example(name: str) -> dict:
    return yaml.safe_load((CHART / "examples" / f"{name}-values.yaml").read_text())


# Every settings key the values schema lets users set through <component>.config, with a valid value.
EVERY_CONFIG = {
    "gateway": {"config": {"served_model_name": "my-model", "tokenizer": "smollm2-135m",
                           "request_timeout_seconds": 120, "backend_timeout_seconds": 30,
                           "startup_timeout_seconds": 900, "max_concurrent_requests": 128, "log_requests": True,
                           "max_queue_len": 64, "max_queue_time_seconds": 30, "max_n": 4,
                           "max_request_body_bytes": 1048576, "draft_fallback": False, "draft_timeout_ms": 2500,
                           "draft_breaker_failures": 5, "draft_breaker_reset_seconds": 10,
                           "responses_store_max_entries": 256, "responses_store_max_bytes": 16777216,
                           "responses_store_ttl_seconds": 600},
                "readinessPath": "/health", "service": {"sessionAffinity": "ClientIP"}},
    "draft": {"config": {"dtype": "bfloat16", "device": "cpu", "max_sequences": 512, "sequence_ttl_seconds": 300,
                         "max_batch_size": 32, "batch_wait_ms": 5, "num_threads": 3, "draft_top_n": 128,
                         "lean_forward": False, "kv_cache_memory": 536870912, "block_size": 32,
                         "enable_prefix_caching": False, "gpu_memory_utilization": 0.3}},
    "target": {"config": {"dtype": "float32", "device": "cpu", "revision": "main", "max_sequences": 100000000,
                          "sequence_ttl_seconds": 600.5, "max_batch_size": 8, "batch_wait_ms": 0,
                          "num_threads": 2, "lean_forward": False, "kv_cache_memory": 4294967296,
                          "block_size": 16, "enable_prefix_caching": True, "gpu_memory_utilization": 0.85,
                          "seeded_sampling": "rejection", "batch_invariant": True, "quantization": "int8",
                          "tree_tile_rows": 32}},
}

CASES = {
    "default": {},
    **{p.name.removesuffix("-values.yaml"): yaml.safe_load(p.read_text()) for p in EXAMPLES},
    "api-key-value": {"gateway": {"apiKey": {"value": API_KEY}}},
    # an EAGLE-3 head: the draft reads the target's embedding from target.model
    "eagle3": {"speculativeConfig": {"method": "eagle3", "model": "smollm2-135m-eagle3", "num_speculative_tokens": 3}},
    # One Secret of the operator's for every pod; HTTPS requiring client certificates, TLS on gRPC too.
    "tls-secret": {"tls": {"enabled": True, "secretName": "specdec-tls", "serverName": "specdec-test-server",
                           "http": {"enabled": True, "clientCertReqs": 2}, "grpc": {"enabled": True}},
                   "metrics": {"serviceMonitor": {"enabled": True}}},
    "everything": merge(example("monitoring"), example("scale-out"), example("tli"), EVERY_CONFIG,
                        {"gateway": {"apiKey": {"value": API_KEY}},
                         "speculativeConfig": {"max_model_len": 4096, "revision": "v1",
                                               "draft_sample_method": "probabilistic",
                                               "tli_proposals": "intersection", "adaptive_k": True,
                                               "quantization": "none"},
                         "networkPolicy": {"gatewayFrom": [{"namespaceSelector": {"matchLabels": {
                             "kubernetes.io/metadata.name": "apps"}}}]}}),
}


@functools.lru_cache(maxsize=None)
def _render_cached(values_json: str) -> tuple[dict, ...]:
    helm = _helm()
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(json.loads(values_json), name=RELEASE, namespace=NAMESPACE)
    notes = {"kind": "NOTES", "text": files.pop("specdec/templates/NOTES.txt", "")}
    docs = [doc for text in files.values() for doc in yaml.safe_load_all(text) if doc]
    return (notes, *docs)


def render(values: dict) -> list[dict]:
    """The rendered objects (and a pseudo-object of kind NOTES with NOTES.txt), as fresh copies."""
    return copy.deepcopy(list(_render_cached(json.dumps(values, sort_keys=True))))


def objects(values: dict, kind: str | None = None) -> list[dict]:
    return [d for d in render(values) if d["kind"] != "NOTES" and (kind is None or d["kind"] == kind)]


def component(obj: dict) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def by_component(values: dict, kind: str) -> dict[str, dict]:
    found = {}
    for obj in objects(values, kind):
        assert component(obj) not in found, f"two {kind}s for {component(obj)}"
        found[component(obj)] = obj
    return found


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def env_of(c: dict) -> dict[str, str]:
    """Plain env values; a secretKeyRef reads as 'secret:<name>/<key>'."""
    out = {}
    for e in c.get("env", []):
        assert e["name"] not in out, f"{e['name']} is set twice"
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        out[e["name"]] = f"secret:{ref['name']}/{ref['key']}" if ref else e["value"]
    return out


def fullname(component_name: str) -> str:
    return f"{RELEASE}-specdec-{component_name}"


# -- lint, schema-valid objects ---------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_lint(case):
    report = _helm().lint(str(CHART), CASES[case], strict=True, namespace=NAMESPACE)
    assert report["errors"] == [], report
    assert not [m for m in report["messages"] if m["severity"] >= 2], report["messages"]


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("case", CASES)
def test_every_object_validates(case, version):
    kv = _kubernetes_validate()
    docs = objects(CASES[case])
    assert {"Deployment", "Service", "ServiceAccount"} <= {d["kind"] for d in docs}
    for doc in docs:
        if doc["kind"] in CRDS:
            continue
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as err:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']} is not valid for Kubernetes {version}: {err}")


def test_validation_is_strict():
    """Negative control: the validator refuses a field Kubernetes does not know."""
    kv = _kubernetes_validate()
    deployment = by_component({}, "Deployment")["target"]
    container(deployment)["startupProbe"]["grpcPort"] = 50052
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, KUBE_VERSIONS[0], strict=True)


def test_defaults_render_what_is_expected():
    kinds = sorted((d["kind"], component(d) if "app.kubernetes.io/component" in d["metadata"]["labels"] else "")
                   for d in objects({}))
    assert kinds == sorted([
        ("ConfigMap", ""), ("ServiceAccount", ""), ("Pod", "test"),
        *[(k, c) for k in ("Deployment", "Service", "PodDisruptionBudget") for c in ("gateway", "draft", "target")],
    ])


# -- values schema ------------------------------------------------------------------------------------

@pytest.mark.parametrize("values, message", [
    ({"replicas": 2}, "additional properties 'replicas' not allowed"),
    ({"target": {"replicaCount": "two"}}, "at '/target/replicaCount': got string, want integer"),
    ({"speculativeConfig": {"num_speculative_tokens": "4"}},
     "at '/speculativeConfig/num_speculative_tokens': got string, want integer"),
    ({"speculativeConfig": {"use_heterogeneous_vocab": "yes"}},
     "at '/speculativeConfig/use_heterogeneous_vocab': got string, want boolean"),
    ({"speculativeConfig": {"num_spec_tokens": 4}}, "additional properties 'num_spec_tokens' not allowed"),
    ({"speculativeConfig": {"method": "eagle"}}, "at '/speculativeConfig/method'"),
    ({"target": {"config": {"max_batch_sise": 8}}}, "additional properties 'max_batch_sise' not allowed"),
    ({"draft": {"config": {"port": 1}}}, "additional properties 'port' not allowed"),
    ({"gateway": {"httpPort": 80000}}, "at '/gateway/httpPort'"),
    ({"target": {"config": {"kv_cache_memory": "lots"}}}, "at '/target/config/kv_cache_memory'"),
    ({"draft": {"config": {"kv_cache_memory": 0}}}, "at '/draft/config/kv_cache_memory'"),
    ({"target": {"config": {"gpu_memory_utilization": 1.5}}}, "at '/target/config/gpu_memory_utilization'"),
    ({"target": {"config": {"block_size": 0}}}, "at '/target/config/block_size'"),
    ({"draft": {"config": {"enable_prefix_caching": "no"}}}, "at '/draft/config/enable_prefix_caching'"),
])
def test_schema_refuses_bad_values(values, message):
    helm = _helm()
    with pytest.raises(helm.HelmValuesError) as info:
        with helm.Chart.load(str(CHART)) as chart:
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert "values don't meet the specifications of the schema" in str(info.value)
    assert message in str(info.value), str(info.value)
    assert any(message in e for e in helm.lint(str(CHART), values)["errors"])


@pytest.mark.parametrize("values, message", [
    ({"gateway": {"apiKey": {"value": "a", "existingSecret": "b"}}}, "set existingSecret or value, not both"),
    ({"target": {"autoscaling": {"enabled": True}}}, "target.autoscaling needs metrics.serviceMonitor.enabled"),
])
def test_contradictions_fail_with_a_reason(values, message):
    helm = _helm()
    with pytest.raises(helm.HelmRenderError, match=message):
        with helm.Chart.load(str(CHART)) as chart:
            chart.render(values, name=RELEASE, namespace=NAMESPACE)


def _schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def test_schema_follows_the_code():
    """speculativeConfig has exactly --speculative-config's keys; limits and defaults are the code's."""
    from draft_service.config import DraftServiceConfig
    from gateway.config import GatewayConfig
    from specdec.config import DEFAULT_EAGLE3_HEAD, DEFAULT_PAIR_NUM_SPECULATIVE_TOKENS, DEFAULT_TARGET, SpeculativeConfig
    from specdec.proposal import MAX_NUM_SPECULATIVE_TOKENS
    from target_service.config import TargetServiceConfig

    schema, values = _schema(), yaml.safe_load((CHART / "values.yaml").read_text())
    spec = schema["properties"]["speculativeConfig"]["properties"]
    assert set(spec) == set(SpeculativeConfig.valid_keys()) == set(values["speculativeConfig"])
    assert spec["num_speculative_tokens"]["maximum"] == MAX_NUM_SPECULATIVE_TOKENS
    assert set(schema["properties"]) - {"global"} == set(values)
    assert values["speculativeConfig"]["num_speculative_tokens"] == DEFAULT_PAIR_NUM_SPECULATIVE_TOKENS
    from specdec.config import default_speculative_config

    pair = default_speculative_config()
    for key, value in pair.items():  # the chart's default values are the embedded default pair's
        if key != "model":  # (empty: draft.model, checked below)
            assert values["speculativeConfig"][key] == value, key
    unset = SpeculativeConfig()  # and every other key the code's default
    for key in set(SpeculativeConfig.valid_keys()) - set(pair) - {"model", "max_model_len", "revision", "quantization"}:
        assert values["speculativeConfig"][key] == getattr(unset, key), key
    assert (values["target"]["model"], values["draft"]["model"]) == (DEFAULT_TARGET, DEFAULT_EAGLE3_HEAD)
    defaults = {f.name: f.default for f in dataclasses.fields(GatewayConfig)}
    assert values["gateway"]["grpcPort"] == defaults["port"]
    assert values["draft"]["port"] == {f.name: f.default for f in dataclasses.fields(DraftServiceConfig)}["port"]
    assert values["target"]["port"] == {f.name: f.default for f in dataclasses.fields(TargetServiceConfig)}["port"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert str(values["draft"]["metricsPort"]) == compose["draft"]["environment"]["SPECDEC_DRAFT_METRICS_PORT"]
    assert str(values["target"]["metricsPort"]) == compose["target"]["environment"]["SPECDEC_TARGET_METRICS_PORT"]
    assert str(values["gateway"]["httpPort"]) == compose["gateway"]["environment"]["SPECDEC_GATEWAY_HTTP_PORT"]


def test_every_config_key_the_schema_allows_is_exercised():
    definitions = _schema()["definitions"]
    for role in ("gateway", "draft", "target"):
        allowed = set(definitions[f"{role}Config"]["properties"])
        assert set(EVERY_CONFIG[role]["config"]) == allowed, role


def test_dtype_choices_are_the_loaders():
    from specdec.engine.models import DTYPES

    assert set(_schema()["definitions"]["targetConfig"]["properties"]["dtype"]["enum"]) == {"auto", *DTYPES}


def test_seeded_sampling_choices_are_the_targets():
    from specdec.seeding import SEEDED_SAMPLING

    prop = _schema()["definitions"]["targetConfig"]["properties"]["seeded_sampling"]
    assert prop["enum"] == list(SEEDED_SAMPLING)


def test_chart_version_follows_the_package():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert chart["appVersion"] == project.group(1)


# -- wiring -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_services_select_exactly_their_pods(case):
    deployments = objects(CASES[case], "Deployment")
    services = objects(CASES[case], "Service")
    assert {component(s) for s in services} == {"gateway", "draft", "target"}
    for service in services:
        selector = service["spec"]["selector"]
        chosen = [d for d in deployments
                  if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert [component(d) for d in chosen] == [component(service)], service["metadata"]["name"]
        (deployment,) = chosen
        assert deployment["spec"]["selector"]["matchLabels"].items() <= \
            deployment["spec"]["template"]["metadata"]["labels"].items()
        ports = {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, (service["metadata"]["name"], port)
        if component(service) == "gateway":
            assert service["spec"].get("clusterIP") != "None"
            assert {p["name"] for p in service["spec"]["ports"]} == {"http", "grpc"}
            # the Responses API's store lives in each pod: affinity only where the values ask for it
            affinity = CASES[case].get("gateway", {}).get("service", {}).get("sessionAffinity", "None")
            assert service["spec"]["sessionAffinity"] == affinity
        else:
            assert service["spec"]["clusterIP"] == "None", "backends need a headless Service"
            assert {p["name"] for p in service["spec"]["ports"]} == {"grpc", "metrics"}


@pytest.mark.parametrize("case", CASES)
def test_gateway_dials_the_backend_services(case):
    deployments = by_component(CASES[case], "Deployment")
    services = by_component(CASES[case], "Service")
    gateway = env_of(container(deployments["gateway"]))
    for role in ("draft", "target"):
        service = services[role]
        port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
        assert gateway[f"SPECDEC_GATEWAY_{role.upper()}_ADDR"] == (
            f"dns:///{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local:{port['port']}")
        backend = container(deployments[role])
        listens = int(env_of(backend)[f"SPECDEC_{role.upper()}_PORT"])
        grpc_port = next(p["containerPort"] for p in backend["ports"] if p["name"] == port["targetPort"])
        assert listens == grpc_port == port["port"]
        assert backend["args"][0] == f"{role}-service"
    gateway_ports = {p["name"]: p["containerPort"] for p in container(deployments["gateway"])["ports"]}
    assert gateway_ports == {"http": int(gateway["SPECDEC_GATEWAY_HTTP_PORT"]),
                             "grpc": int(gateway["SPECDEC_GATEWAY_PORT"])}
    svc_ports = {p["name"]: p["port"] for p in services["gateway"]["spec"]["ports"]}
    assert svc_ports == gateway_ports


@pytest.mark.parametrize("case", CASES)
def test_probes_hit_container_ports(case):
    from specdec.entrypoints import healthcheck

    tls = merge(yaml.safe_load((CHART / "values.yaml").read_text()), CASES[case])["tls"]
    tls_files = [f"{tls['mountPath']}/{name}" for name in ("ca.crt", "tls.crt", "tls.key")]
    for role, deployment in by_component(CASES[case], "Deployment").items():
        c = container(deployment)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        env = env_of(c)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]
            if role == "gateway":
                assert ports["http"] == int(env["SPECDEC_GATEWAY_HTTP_PORT"])
                ready = CASES[case].get("gateway", {}).get("readinessPath", "/ready")
                path = ready if kind == "readinessProbe" else "/health"
                if tls["http"]["enabled"] and tls["http"]["clientCertReqs"] == 2:  # kubelet has no certificate
                    command = probe["exec"]["command"]
                    assert command[:2] == ["python", "-c"] and command[4:] == tls_files
                    assert command[3] == f"https://localhost:{ports['http']}{path}"
                else:
                    assert probe["httpGet"]["port"] == "http" and probe["httpGet"]["path"] == path
                    assert probe["httpGet"].get("scheme", "HTTP") == ("HTTPS" if tls["http"]["enabled"] else "HTTP")
            elif tls["enabled"]:  # kubelet's gRPC probe speaks plaintext only: the image's probe, over TLS
                command = probe["exec"]["command"]
                assert command[:3] == ["python", "-m", "specdec.entrypoints.healthcheck"]
                args = healthcheck.build_parser().parse_args(command[3:])
                assert args.address == f"localhost:{ports['grpc']}" == f"localhost:{env[f'SPECDEC_{role.upper()}_PORT']}"
                assert [args.tls_ca_file, args.tls_cert_file, args.tls_key_file] == tls_files
                assert args.tls_server_name == env_of(container(by_component(CASES[case], "Deployment")["gateway"]))[
                    "SPECDEC_GATEWAY_BACKEND_TLS_SERVER_NAME"]
            else:
                assert probe["grpc"]["port"] == ports["grpc"] == int(env[f"SPECDEC_{role.upper()}_PORT"])
        start = c["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] >= 600, "model loading takes minutes"
        if role != "gateway":
            assert ports["metrics"] == int(env[f"SPECDEC_{role.upper()}_METRICS_PORT"])


def _cli_settings() -> dict[str, tuple[type, str]]:
    from draft_service.config import ENV_PREFIX as DRAFT, DraftServiceConfig
    from gateway.config import ENV_PREFIX as GATEWAY, GatewayConfig
    from target_service.config import ENV_PREFIX as TARGET, TargetServiceConfig

    return {"gateway": (GatewayConfig, GATEWAY), "draft-service": (DraftServiceConfig, DRAFT),
            "target-service": (TargetServiceConfig, TARGET)}


# Read by the CLI itself (specdec.entrypoints.cli) and by the model cache (specdec.engine.models).
GLOBAL_ENV = {"SPECDEC_LOG_LEVEL", "SPECDEC_LOG_FORMAT", "SPECDEC_CACHE"}


@pytest.mark.parametrize("case", CASES)
def test_every_specdec_variable_is_a_cli_setting(case):
    for deployment in objects(CASES[case], "Deployment"):
        c = container(deployment)
        cls, prefix = _cli_settings()[c["args"][0]]
        known = {f"{prefix}_{f.name.upper()}" for f in dataclasses.fields(cls)} | GLOBAL_ENV
        unknown = {name for name in env_of(c) if name.startswith("SPECDEC_")} - known
        assert not unknown, f"{deployment['metadata']['name']}: the CLI reads no {sorted(unknown)}"


def _parse_like_the_cli(monkeypatch, c: dict):
    """The config the `specdec` CLI builds from this container's env and args (secrets: placeholders)."""
    from specdec.entrypoints import cli
    from specdec.serving import settings

    for name in [n for n in os.environ if n.startswith("SPECDEC_")]:
        monkeypatch.delenv(name)
    env = env_of(c)
    for name, value in env.items():
        monkeypatch.setenv(name, API_KEY if value.startswith("secret:") else value)
    args = cli.build_parser().parse_args(c["args"])  # a bad value exits here, naming the variable
    assert args.log_format == env["SPECDEC_LOG_FORMAT"] and args.log_level == env["SPECDEC_LOG_LEVEL"]
    cls, _ = _cli_settings()[c["args"][0]]
    return settings.from_args(cls, args)


@pytest.mark.parametrize("case", CASES)
def test_the_cli_reads_the_containers_settings(case, monkeypatch):
    """Parse each container's env + args with the CLI's own parser; the configs say what the values say."""
    values = merge(yaml.safe_load((CHART / "values.yaml").read_text()), CASES[case])
    spec = values["speculativeConfig"]
    deployments = by_component(CASES[case], "Deployment")
    gateway = _parse_like_the_cli(monkeypatch, container(deployments["gateway"]))
    draft = _parse_like_the_cli(monkeypatch, container(deployments["draft"]))
    target = _parse_like_the_cli(monkeypatch, container(deployments["target"]))

    assert target.model == values["target"]["model"]
    assert draft.model == (spec["model"] or values["draft"]["model"])
    assert (draft.port, target.port, gateway.port, gateway.http_port) == (
        values["draft"]["port"], values["target"]["port"], values["gateway"]["grpcPort"], values["gateway"]["httpPort"])
    assert (draft.metrics_port, target.metrics_port) == (values["draft"]["metricsPort"], values["target"]["metricsPort"])
    assert gateway.num_speculative_tokens == spec["num_speculative_tokens"]
    assert gateway.draft_sample_method == draft.draft_sample_method == spec["draft_sample_method"]
    assert gateway.use_heterogeneous_vocab is spec["use_heterogeneous_vocab"]
    assert gateway.adaptive_k is spec["adaptive_k"]
    assert draft.target_tokenizer == (target.model if spec["use_heterogeneous_vocab"] else None)
    assert draft.target_model == (target.model if spec["method"] == "eagle3" else None)
    assert draft.method == spec["method"]
    assert draft.tli_proposals == spec["tli_proposals"]
    assert draft.revision == spec["revision"]
    assert draft.quantization == (spec["quantization"] or "auto")  # null: the draft's default (int8)
    assert gateway.max_model_len == draft.max_model_len == target.max_model_len == spec["max_model_len"]
    assert gateway.api_key == ([API_KEY] if values["gateway"]["apiKey"]["value"]
                               or values["gateway"]["apiKey"]["existingSecret"] else [])
    for role, config in (("gateway", gateway), ("draft", draft), ("target", target)):
        for name, value in values[role]["config"].items():
            assert getattr(config, name) == value, (role, name)
    # A container sees every core of its node: the chart passes the CPU limit's whole cores.
    for role, config in (("draft", draft), ("target", target)):
        resources = values[role]["resources"]
        cpu = resources.get("limits", {}).get("cpu") or resources.get("requests", {}).get("cpu")
        expected = values[role]["config"].get("num_threads", int(float(cpu)) if cpu else 0)
        assert config.num_threads == expected, role


@pytest.mark.parametrize("size, size_bytes", [("2GiB", 2 * 1024**3), ("512MiB", 512 * 1024**2), ("1e9", 10**9),
                                              (1073741824, 2**30), ("1.5GB", 1_500_000_000)])
def test_kv_cache_memory_takes_a_size_the_services_read(size, size_bytes, monkeypatch):
    """The pool's size as a number of bytes or a size string reaches both backends as the CLI reads it."""
    values = {role: {"config": {"kv_cache_memory": size, "enable_prefix_caching": False, "block_size": 32}}
              for role in ("draft", "target")}
    deployments = by_component(values, "Deployment")
    for role in ("draft", "target"):
        c = container(deployments[role])
        assert env_of(c)[f"SPECDEC_{role.upper()}_KV_CACHE_MEMORY"] == str(size)
        config = _parse_like_the_cli(monkeypatch, c)
        assert (config.kv_cache_memory, config.enable_prefix_caching, config.block_size) == (size_bytes, False, 32)


@pytest.mark.parametrize("cpu, threads", [("1500m", "1"), ("250m", "1"), ("0.5", "1"), (3, "3"), ("2.7", "2")])
def test_threads_follow_the_cpu_limit(cpu, threads):
    deployment = by_component({"target": {"resources": {"limits": {"cpu": cpu}}}}, "Deployment")["target"]
    assert env_of(container(deployment))["SPECDEC_TARGET_NUM_THREADS"] == threads


@pytest.mark.heavy
def test_gateway_waits_for_the_backends_names():
    """The init container waits for exactly the names the gateway dials, and returns once they resolve."""
    gateway = by_component({}, "Deployment")["gateway"]
    (init,) = gateway["spec"]["template"]["spec"]["initContainers"]
    env = env_of(container(gateway))
    dialed = [env[f"SPECDEC_GATEWAY_{role}_ADDR"].removeprefix("dns:///").rsplit(":", 1)[0]
              for role in ("DRAFT", "TARGET")]
    assert env_of(init)["BACKENDS"].split() == dialed
    assert init["image"] == container(gateway)["image"]
    script = [sys.executable, *init["command"][1:], *init["args"]]
    done = subprocess.run(script, env={**os.environ, "BACKENDS": "localhost 127.0.0.1"}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.count("resolved") == 2, done.stdout + done.stderr
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(script, env={**os.environ, "BACKENDS": "localhost no-such-backend.invalid"},
                       capture_output=True, timeout=5)
    assert "initContainers" not in by_component({"gateway": {"waitForBackends": False}}, "Deployment")[
        "gateway"]["spec"]["template"]["spec"]


def test_gpu_example_requests_gpus_and_cuda():
    values = CASES["gpu"]
    deployments = by_component(values, "Deployment")
    for role in ("draft", "target"):
        c = container(deployments[role])
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert deployments[role]["spec"]["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert env_of(container(deployments["target"]))["SPECDEC_TARGET_DEVICE"] == "cuda"
    assert container(deployments["draft"])["args"] == ["draft-service", "--device", "cuda"]


def test_api_key_from_a_secret():
    mine = by_component(CASES["api-key"], "Deployment")
    assert env_of(container(mine["gateway"]))["SPECDEC_GATEWAY_API_KEY"] == "secret:specdec-api-key/api-key"
    assert not objects(CASES["api-key"], "Secret"), "an existing Secret is not the chart's to make"
    made = by_component(CASES["api-key-value"], "Deployment")
    (secret,) = objects(CASES["api-key-value"], "Secret")
    assert base64.b64decode(secret["data"]["api-key"]).decode() == API_KEY
    assert env_of(container(made["gateway"]))["SPECDEC_GATEWAY_API_KEY"] == \
        f"secret:{secret['metadata']['name']}/api-key"
    for case in ("default", "api-key", "api-key-value"):
        (test_pod,) = objects(CASES[case], "Pod")
        has_key = any(e["name"] == "API_KEY" for e in test_pod["spec"]["containers"][0].get("env", []))
        assert has_key == (case != "default")
        assert "API_KEY" not in str(env_of(container(by_component(CASES[case], "Deployment")["draft"])))


@pytest.mark.parametrize("case", ["default", "monitoring", "everything"])
def test_metrics_are_collected(case):
    values = CASES[case]
    monitors = by_component(values, "ServiceMonitor")
    enabled = values.get("metrics", {}).get("serviceMonitor", {}).get("enabled", False)
    assert set(monitors) == ({"gateway", "draft", "target"} if enabled else set())
    services = by_component(values, "Service")
    for role, monitor in monitors.items():
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["spec"]["selector"]["matchLabels"].items() <= services[role]["metadata"]["labels"].items()
        assert [o for o in objects(values, "Service")
                if monitor["spec"]["selector"]["matchLabels"].items() <= o["metadata"]["labels"].items()] \
            == [services[role]]
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] in {p["name"] for p in services[role]["spec"]["ports"]}
        assert endpoint["port"] == ("http" if role == "gateway" else "metrics")
        assert endpoint["path"] == "/metrics" and endpoint["honorLabels"] is True  # keep the series' `service`
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_dashboards_configmap_holds_exactly_the_dashboard_files():
    (configmap,) = objects({}, "ConfigMap")
    files = sorted((CHART / "dashboards").glob("*.json"))
    assert files, "no dashboards in helm/specdec/dashboards"
    assert configmap["data"] == {p.name: p.read_text() for p in files}
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    for text in configmap["data"].values():
        json.loads(text)
    (elsewhere,) = objects(CASES["monitoring"], "ConfigMap")
    assert elsewhere["metadata"]["namespace"] == "monitoring"
    assert not objects({"metrics": {"grafanaDashboards": {"enabled": False}}}, "ConfigMap")


def test_packaged_chart_carries_the_dashboards(tmp_path):
    archive = _helm().package(str(CHART), destination=str(tmp_path))
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    for p in (CHART / "dashboards").glob("*.json"):
        assert f"specdec/dashboards/{p.name}" in names
    assert "specdec/values.schema.json" in names and "specdec/templates/NOTES.txt" in names


@pytest.mark.parametrize("case", CASES)
def test_pods_are_locked_down(case):
    pods = [d["spec"]["template"]["spec"] for d in objects(CASES[case], "Deployment")]
    pods += [p["spec"] for p in objects(CASES[case], "Pod")]
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]}
            if c["name"] == "wait-for-backends":
                continue  # writes nothing
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert "emptyDir" in volumes[mounts["/tmp"]]
            if c["name"] != "completion":
                cache = env_of(c)["SPECDEC_CACHE"]
                assert cache == "/cache" and mounts[cache] == "model-cache"


def test_model_cache_on_a_claim():
    (claim,) = objects(CASES["scale-out"], "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for deployment in objects(CASES["scale-out"], "Deployment"):
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    mine = objects({"modelCache": {"persistentVolumeClaim": {"enabled": True, "existingClaim": "models"}}})
    assert not [o for o in mine if o["kind"] == "PersistentVolumeClaim"]
    assert all(v["persistentVolumeClaim"]["claimName"] == "models" for d in mine if d["kind"] == "Deployment"
               for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "model-cache")


@pytest.mark.parametrize("case", ["monitoring", "everything"])
def test_network_policy_lets_only_gateways_reach_backends(case):
    values = CASES[case]
    policies = by_component(values, "NetworkPolicy")
    deployments = by_component(values, "Deployment")
    gateway_labels = deployments["gateway"]["spec"]["template"]["metadata"]["labels"]
    for role in ("draft", "target"):
        policy = policies[role]["spec"]
        pod_labels = deployments[role]["spec"]["template"]["metadata"]["labels"]
        assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
        assert policy["policyTypes"] == ["Ingress"]
        ports = {p["name"]: p["containerPort"] for p in container(deployments[role])["ports"]}
        grpc_rule, metrics_rule = policy["ingress"]
        (peer,) = grpc_rule["from"]
        assert set(peer) == {"podSelector"}, "gateway pods of this namespace only"
        assert peer["podSelector"]["matchLabels"].items() <= gateway_labels.items()
        for other in ("draft", "target"):
            other_labels = deployments[other]["spec"]["template"]["metadata"]["labels"]
            assert not peer["podSelector"]["matchLabels"].items() <= other_labels.items()
        assert [p["port"] for p in grpc_rule["ports"]] == [ports["grpc"]]
        assert [p["port"] for p in metrics_rule["ports"]] == [ports["metrics"]]
        assert metrics_rule["from"] == values["networkPolicy"]["metricsFrom"]
    gateway_policy = policies["gateway"]["spec"]
    (rule,) = gateway_policy["ingress"]
    gateway_ports = {p["containerPort"] for p in container(deployments["gateway"])["ports"]}
    assert {p["port"] for p in rule["ports"]} == gateway_ports
    if values["networkPolicy"].get("gatewayFrom"):
        (test_pod,) = objects(values, "Pod")
        assert any(p.get("podSelector", {}).get("matchLabels", {}).items() <= test_pod["metadata"]["labels"].items()
                   for p in rule["from"] if "podSelector" in p), "`helm test` must still reach the gateway"
    else:
        assert "from" not in rule
    assert not objects({}, "NetworkPolicy")


def test_replicas_autoscaling_and_disruption_budgets():
    values = CASES["scale-out"]
    deployments = by_component(values, "Deployment")
    assert "replicas" not in deployments["gateway"]["spec"], "the HPA owns the gateway's replicas"
    assert (deployments["draft"]["spec"]["replicas"], deployments["target"]["spec"]["replicas"]) == (2, 3)
    (hpa,) = objects(values, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployments["gateway"]["metadata"]["name"]}
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert container(deployments["gateway"])["resources"]["requests"]["cpu"]
    budgets = by_component(values, "PodDisruptionBudget")
    assert budgets["gateway"]["spec"]["minAvailable"] == 1 and budgets["target"]["spec"]["maxUnavailable"] == 1
    for role, budget in budgets.items():
        pod_labels = deployments[role]["spec"]["template"]["metadata"]["labels"]
        assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        assert budget["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == role


def test_target_scales_on_the_gateways_queue():
    values = CASES["monitoring"]
    hpas = by_component(values, "HorizontalPodAutoscaler")
    assert set(hpas) == {"target"}
    (metric,) = hpas["target"]["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == "specdec_num_requests_waiting"
    assert metric["external"]["metric"]["selector"]["matchLabels"] == {
        "service": "gateway", "app_kubernetes_io_instance": RELEASE}
    assert hpas["target"]["spec"]["scaleTargetRef"]["name"] == fullname("target")
    assert "replicas" not in by_component(values, "Deployment")["target"]["spec"]
    # The series get that label from the ServiceMonitors (Prometheus Operator sanitises the name).
    monitor = by_component(values, "ServiceMonitor")["gateway"]
    assert monitor["spec"]["targetLabels"] == ["app.kubernetes.io/instance"]
    from specdec.serving.metrics import REQUESTS_WAITING

    assert REQUESTS_WAITING._name == "specdec_num_requests_waiting"


def test_notes_tell_how_to_reach_the_api():
    (notes,) = [d for d in render(CASES["api-key-value"]) if d["kind"] == "NOTES"]
    text = notes["text"]
    assert f"port-forward svc/{fullname('gateway')} 8000:8000 50050:50050" in text
    assert "curl -s http://localhost:8000/v1/completions" in text
    assert 'Authorization: Bearer $SPECDEC_API_KEY' in text
    assert f"helm test {RELEASE}" in text


# -- the `helm test` pod ------------------------------------------------------------------------------

def test_helm_test_pod_talks_to_the_gateway_service():
    (pod,) = objects(CASES["api-key-value"], "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    env = env_of(c)
    service = by_component(CASES["api-key-value"], "Service")["gateway"]
    http = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "http")
    assert env["GATEWAY_URL"] == f"http://{service['metadata']['name']}:{http}"
    assert env["API_KEY"] == f"secret:{fullname('api-key')}/api-key"
    gateway = container(by_component(CASES["api-key-value"], "Deployment")["gateway"])
    assert c["image"] == gateway["image"] and c["command"] == ["python", "-c"]


def test_helm_test_script_against_a_gateway_dialing_dns_addresses(target_dir, good_draft_dir, monkeypatch):
    """The test pod's own script, run against a real gateway configured by the chart's env (parsed by
    the CLI) that dials its backends by dns:///host:port addresses, as in the cluster (tiny models, a key)."""
    from gateway.server import create_server
    from tests.gateway.openai.http_helpers import HOST, KEY, base_url, serve

    values = CASES["api-key-value"]
    (pod,) = objects(values, "Pod")
    (c,) = pod["spec"]["containers"]
    env = {k: v for k, v in env_of(c).items() if not v.startswith("secret:")}
    chart_config = _parse_like_the_cli(monkeypatch, container(by_component(values, "Deployment")["gateway"]))
    assert chart_config.draft_addr.startswith("dns:///") and chart_config.target_addr.startswith("dns:///")
    stack = serve(target_dir, good_draft_dir, api_key=KEY)
    gateway = None
    try:
        gateway = create_server(dataclasses.replace(
            chart_config, draft_addr=f"dns:///localhost:{stack.draft.port}",
            target_addr=f"dns:///localhost:{stack.target.port}", host=HOST, port=0, http_port=0, api_key=KEY,
            startup_timeout_seconds=60.0))
        run = lambda key: subprocess.run(  # noqa: E731
            [sys.executable, *c["command"][1:], *c["args"]], capture_output=True, text=True, timeout=300,
            env={**os.environ, **env, "GATEWAY_URL": base_url(gateway.http_port), "API_KEY": key})
        ok = run(KEY)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert ok.stdout.splitlines()[-1].startswith("ok: ")
        assert json.loads(ok.stdout[:ok.stdout.rindex("\nok: ")])["usage"]["spec_decode"]["num_draft_tokens"] > 0
        refused = run("wrong-key")
        assert refused.returncode != 0 and "401" in refused.stderr, refused.stderr
    finally:
        if gateway is not None:
            gateway.stop(0)
        stack.stop(0)


# -- the image the chart runs ---------------------------------------------------------------------------

def test_dockerfile_builds_the_image_the_chart_expects():
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.strip()
             and not ln.strip().startswith("#")]
    text = "\n".join(lines)
    assert "USER 10001:10001" in lines and "--uid 10001" in text
    assert 'ENTRYPOINT ["specdec"]' in lines
    assert "SPECDEC_CACHE=/cache" in text and "chown 10001:10001 /cache" in text
    exposed = {int(p) for ln in lines if ln.startswith("EXPOSE") for p in ln.split()[1:]}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert {values["gateway"]["httpPort"], values["gateway"]["grpcPort"], values["draft"]["port"],
            values["draft"]["metricsPort"], values["target"]["port"], values["target"]["metricsPort"]} <= exposed
    assert values["modelCache"]["mountPath"] == "/cache"
    assert "import specdec.entrypoints.healthcheck" in text  # the probe docker-compose runs is in the image


def test_ngram_and_hybrid_drafting_reach_the_draft_service():
    """speculativeConfig's n-gram keys become the draft service's and the gateway's settings."""
    docs = render({"speculativeConfig": {"method": "ngram", "prompt_lookup_max": 5, "prompt_lookup_min": 2,
                                          "disable_by_batch_size": 8}})
    env = {d["metadata"]["name"]: {e["name"]: e.get("value") for e in
                                   d["spec"]["template"]["spec"]["containers"][0].get("env", [])}
           for d in docs if d["kind"] == "Deployment"}
    draft = next(v for k, v in env.items() if k.endswith("draft"))
    gateway = next(v for k, v in env.items() if k.endswith("gateway"))
    assert (draft["SPECDEC_DRAFT_METHOD"], draft["SPECDEC_DRAFT_PROMPT_LOOKUP_MAX"],
            draft["SPECDEC_DRAFT_PROMPT_LOOKUP_MIN"]) == ("ngram", "5", "2")
    assert gateway["SPECDEC_GATEWAY_DISABLE_BY_BATCH_SIZE"] == "8"


# -- TLS ------------------------------------------------------------------------------------------------

TLS_DIR = "/etc/specdec/tls"
TLS_FILES = {"ca": f"{TLS_DIR}/ca.crt", "cert": f"{TLS_DIR}/tls.crt", "key": f"{TLS_DIR}/tls.key"}
CERT_MANAGER = {"tls": {"enabled": True, "certManager": {"enabled": True, "issuerRef": {"name": "my-ca"}},
                        "http": {"enabled": True}}}


def _pod(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def _mounted_secret(deployment: dict) -> str:
    """The Secret mounted read-only at the TLS folder of this Deployment's container."""
    (mount,) = [m for m in container(deployment)["volumeMounts"] if m["mountPath"] == TLS_DIR]
    assert mount["readOnly"] is True
    (volume,) = [v for v in _pod(deployment)["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["defaultMode"] == 0o440
    return volume["secret"]["secretName"]


@pytest.mark.parametrize("case", ["tls-secret", "tls"])
def test_tls_mounts_the_secret_and_sets_every_hop(case, monkeypatch):
    values = CASES[case]
    deployments = by_component(values, "Deployment")
    for role, deployment in deployments.items():
        expected = "specdec-tls" if case == "tls-secret" else f"{fullname(role)}-tls"
        assert _mounted_secret(deployment) == expected, role
    configs = {role: _parse_like_the_cli(monkeypatch, container(d)) for role, d in deployments.items()}
    for role in ("draft", "target"):  # TLS only, clients need a certificate from ca.crt
        c = configs[role]
        assert (c.tls_cert_file, c.tls_key_file, c.tls_client_ca_file) == (
            TLS_FILES["cert"], TLS_FILES["key"], TLS_FILES["ca"])
    gateway = configs["gateway"]
    assert (gateway.backend_tls_ca_file, gateway.backend_tls_cert_file, gateway.backend_tls_key_file) == (
        TLS_FILES["ca"], TLS_FILES["cert"], TLS_FILES["key"])
    assert gateway.backend_tls_server_name == ("specdec-test-server" if case == "tls-secret"
                                               else f"{RELEASE}-specdec-backends.{NAMESPACE}.svc")
    assert (gateway.ssl_certfile, gateway.ssl_keyfile) == (TLS_FILES["cert"], TLS_FILES["key"])
    reqs = values["tls"]["http"]["clientCertReqs"]
    assert (gateway.ssl_ca_certs, gateway.ssl_cert_reqs) == ((TLS_FILES["ca"], 2) if case == "tls-secret" else (None, 0))
    grpc_tls = values["tls"].get("grpc", {}).get("enabled", False)
    assert (gateway.tls_cert_file, gateway.tls_key_file) == ((TLS_FILES["cert"], TLS_FILES["key"]) if grpc_tls
                                                             else (None, None))
    assert gateway.tls_client_ca_file is None
    # `helm test` reaches the gateway over HTTPS, trusting the release's CA (its certificate when asked).
    (pod,) = objects(values, "Pod")
    (c,) = pod["spec"]["containers"]
    env = env_of(c)
    assert env["GATEWAY_URL"].startswith(f"https://{fullname('gateway')}:")
    assert env["CA_FILE"] == TLS_FILES["ca"] and ("CERT_FILE" in env) == (reqs > 0)
    assert {m["mountPath"]: m.get("readOnly") for m in c["volumeMounts"]}[TLS_DIR] is True
    assert [v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v] == [
        _mounted_secret(deployments["gateway"])]


def test_without_tls_nothing_is_mounted_or_set():
    for deployment in objects({}, "Deployment"):
        c = container(deployment)
        assert not [n for n in env_of(c) if "TLS" in n or "SSL" in n]
        assert not [v for v in _pod(deployment)["volumes"] if "secret" in v]
    assert not objects({}, "Certificate")


def test_mutual_off_serves_tls_without_client_certificates(monkeypatch):
    deployments = by_component({"tls": {"enabled": True, "secretName": "s", "mutual": False}}, "Deployment")
    target = _parse_like_the_cli(monkeypatch, container(deployments["target"]))
    assert (target.tls_cert_file, target.tls_client_ca_file) == (TLS_FILES["cert"], None)
    gateway = _parse_like_the_cli(monkeypatch, container(deployments["gateway"]))
    assert (gateway.backend_tls_ca_file, gateway.backend_tls_cert_file) == (TLS_FILES["ca"], None)
    assert "--tls-cert-file" not in container(deployments["target"])["readinessProbe"]["exec"]["command"]


def test_cert_manager_renders_a_certificate_per_service():
    values = merge(CASES["tls"], {"tls": {"certManager": {"issuerRef": {"kind": "ClusterIssuer"}}}})
    certificates = by_component(values, "Certificate")
    deployments = by_component(values, "Deployment")
    services = by_component(values, "Service")
    gateway_env = env_of(container(deployments["gateway"]))
    assert set(certificates) == {"gateway", "draft", "target"}
    for role, certificate in certificates.items():
        spec = certificate["spec"]
        assert certificate["apiVersion"] == "cert-manager.io/v1"
        assert spec["secretName"] == _mounted_secret(deployments[role])
        assert spec["issuerRef"] == {"name": "specdec-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
        assert {"server auth", "client auth"} <= set(spec["usages"])  # serves, and dials (mutual TLS, probes)
        service = services[role]["metadata"]["name"]
        assert f"{service}.{NAMESPACE}.svc.cluster.local" in spec["dnsNames"] and service in spec["dnsNames"]
        if role == "gateway":
            assert "llm.example.internal" in spec["dnsNames"]
            assert gateway_env["SPECDEC_GATEWAY_SSL_CERTFILE"] == TLS_FILES["cert"]
        else:  # the name the gateway checks: it dials the pods' addresses
            assert gateway_env["SPECDEC_GATEWAY_BACKEND_TLS_SERVER_NAME"] in spec["dnsNames"]
            dialed = gateway_env[f"SPECDEC_GATEWAY_{role.upper()}_ADDR"].removeprefix("dns:///").rsplit(":", 1)[0]
            assert dialed in spec["dnsNames"]
        for duration in (spec["duration"], spec["renewBefore"]):
            assert re.fullmatch(r"[0-9]+h", duration)
    assert not objects(CASES["tls-secret"], "Certificate"), "an existing Secret is not the chart's to make"


def test_gateway_metrics_are_scraped_over_https():
    monitor = by_component(CASES["tls-secret"], "ServiceMonitor")["gateway"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    tls = endpoint["tlsConfig"]
    assert tls["ca"]["secret"] == {"name": "specdec-tls", "key": "ca.crt"}
    assert tls["cert"]["secret"] == {"name": "specdec-tls", "key": "tls.crt"}
    assert tls["keySecret"] == {"name": "specdec-tls", "key": "tls.key"}
    for role in ("draft", "target"):  # their metrics ports are plain HTTP
        assert "scheme" not in by_component(CASES["tls-secret"], "ServiceMonitor")[role]["spec"]["endpoints"][0]


# -- stopping: drain window, preStop, grace period --------------------------------------------------------

@pytest.mark.parametrize("values, grace, sleep, drain", [
    ({}, 35, 5, 25),
    ({"drainGraceSeconds": 60}, 70, 5, 60),
    ({"preStopSleepSeconds": 0, "drainGraceSeconds": 10}, 15, None, 10),
    ({"gateway": {"terminationGracePeriodSeconds": 120}, "draft": {"terminationGracePeriodSeconds": 30},
      "target": {"terminationGracePeriodSeconds": 300}}, {"gateway": 120, "draft": 30, "target": 300}, 5, 25),
])
def test_a_stopping_pod_drains_within_its_grace_period(values, grace, sleep, drain, monkeypatch):
    for role, deployment in by_component(values, "Deployment").items():
        pod, c = _pod(deployment), container(deployment)
        expected = grace[role] if isinstance(grace, dict) else grace
        assert pod["terminationGracePeriodSeconds"] == expected, role
        prestop = c.get("lifecycle", {}).get("preStop")
        assert (prestop["exec"]["command"] if prestop else None) == (["sleep", str(sleep)] if sleep else None)
        assert env_of(c)[f"SPECDEC_{role.upper()}_DRAIN_GRACE_SECONDS"] == str(drain)
        assert (sleep or 0) + drain <= expected, "the kubelet would kill the pod mid-drain"
        config = _parse_like_the_cli(monkeypatch, c)
        assert config.drain_grace_seconds == drain


@pytest.mark.parametrize("values, message", [
    ({"tls": {"enabled": True}}, "tls.enabled needs tls.secretName"),
    ({"tls": {"enabled": True, "secretName": "s", "certManager": {"enabled": True, "issuerRef": {"name": "ca"}}}},
     "set secretName .* or certManager.enabled .*, not both"),
    ({"tls": {"enabled": True, "certManager": {"enabled": True}}}, "tls.certManager needs issuerRef.name"),
    ({"tls": {"http": {"enabled": True}}}, "tls.http.enabled and tls.grpc.enabled need tls.enabled"),
    ({"tls": {"enabled": True, "secretName": "s", "http": {"clientCertReqs": 2}}},
     "tls.http.clientCertReqs needs tls.http.enabled"),
    ({"target": {"terminationGracePeriodSeconds": 20}},
     "terminationGracePeriodSeconds 20 is shorter than preStopSleepSeconds \\+ drainGraceSeconds \\(30\\)"),
])
def test_tls_and_drain_contradictions_fail_with_a_reason(values, message):
    helm = _helm()
    with pytest.raises(helm.HelmRenderError, match=message):
        with helm.Chart.load(str(CHART)) as chart:
            chart.render(values, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize("values, message", [
    ({"tls": {"http": {"clientCertReqs": 3}}}, "at '/tls/http/clientCertReqs'"),
    ({"tls": {"mountPath": "etc/tls"}}, "at '/tls/mountPath'"),
    ({"tls": {"secretName": 7}}, "at '/tls/secretName': got number, want string"),
    ({"tls": {"certManager": {"issuerRef": {"kind": ""}}}}, "at '/tls/certManager/issuerRef/kind'"),
    ({"tls": {"certManager": {"duration": "90 days"}}}, "at '/tls/certManager/duration'"),
    ({"tls": {"cert": "x"}}, "additional properties 'cert' not allowed"),
    ({"drainGraceSeconds": -1}, "at '/drainGraceSeconds'"),
    ({"drainGraceSeconds": "25"}, "at '/drainGraceSeconds': got string, want integer"),
    ({"preStopSleepSeconds": 1.5}, "at '/preStopSleepSeconds'"),
    ({"gateway": {"terminationGracePeriodSeconds": "long"}}, "at '/gateway/terminationGracePeriodSeconds'"),
])
def test_schema_refuses_bad_tls_and_drain_values(values, message):
    test_schema_refuses_bad_values(values, message)


def test_the_charts_tls_settings_serve_over_mutual_tls(pki, target_dir, eagle3_head_dir, monkeypatch):
    """The tls-secret case's containers, configured by their rendered env (parsed by the CLI) with the
    Secret's paths pointing at test certificates: the backends serve mutual TLS, the gateway dials their
    resolved addresses (dns:///) checking the chart's serverName, and HTTPS requires client certificates.
    The rendered probes, run as they would in the pods, pass; a client without a certificate is refused."""
    import ssl

    from draft_service.server import create_server as create_draft
    from gateway.server import create_server as create_gateway
    from target_service.server import create_server as create_target
    from tests.gateway.openai.http_helpers import HOST, httpx

    files = {TLS_FILES["ca"]: pki.ca, TLS_FILES["cert"]: pki.pod_cert, TLS_FILES["key"]: pki.pod_key}
    remap = lambda config: dataclasses.replace(config, **{  # noqa: E731
        f.name: files[value] for f in dataclasses.fields(config)
        if isinstance(value := getattr(config, f.name), str) and value in files})
    deployments = by_component(CASES["tls-secret"], "Deployment")
    chart = {role: remap(_parse_like_the_cli(monkeypatch, container(d))) for role, d in deployments.items()}
    local = {"host": HOST, "port": 0, "metrics_port": None, "num_threads": 1}
    handles = []
    try:
        target = create_target(dataclasses.replace(chart["target"], model=str(target_dir), **local))
        handles.append(target)
        assert chart["draft"].method == "eagle3"  # the default pair's head, here the tiny target's
        draft = create_draft(dataclasses.replace(chart["draft"], model=str(eagle3_head_dir), target_model=str(target_dir),
                                                 quantization="none", **local))
        handles.append(draft)
        gateway = create_gateway(dataclasses.replace(
            chart["gateway"], draft_addr=f"dns:///localhost:{draft.port}", target_addr=f"dns:///localhost:{target.port}",
            host=HOST, port=0, http_port=0, startup_timeout_seconds=60.0))
        handles.append(gateway)
        ports = {"draft": draft.port, "target": target.port, "gateway": gateway.http_port}

        def probe(role: str) -> subprocess.CompletedProcess:
            c = container(deployments[role])
            command = [files.get(a, a) for a in c["readinessProbe"]["exec"]["command"]]
            listens = {"gateway": c["ports"][0]["containerPort"], "draft": chart["draft"].port,
                       "target": chart["target"].port}[role]
            command = [a.replace(f"localhost:{listens}", f"localhost:{ports[role]}") for a in command]
            return subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, timeout=120)

        for role in ("target", "draft", "gateway"):
            done = probe(role)
            assert done.returncode == 0, (role, done.stdout, done.stderr)

        context = ssl.create_default_context(cafile=pki.ca)
        context.load_cert_chain(pki.pod_cert, pki.pod_key)
        url = f"https://{HOST}:{gateway.http_port}"
        with httpx.Client(verify=context, timeout=120) as client:
            model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
            out = client.post(f"{url}/v1/completions", json={"model": model, "prompt": "The quick brown fox",
                                                             "max_tokens": 4, "temperature": 0})
            assert out.status_code == 200, out.text
            assert out.json()["usage"]["completion_tokens"] == 4
        with httpx.Client(verify=ssl.create_default_context(cafile=pki.ca), timeout=30) as anonymous, \
                pytest.raises(httpx.TransportError):
            anonymous.get(f"{url}/health")
    finally:
        for handle in reversed(handles):
            handle.stop(0)
