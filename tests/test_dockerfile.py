"""The Dockerfile, read with a real parser (dockerfile-parse), and its build (scripts/build-image.sh).

Parsed: the base image, the order of the instructions, every COPY source exists and every package
``pip install .`` installs is copied, the entrypoint is the ``specdec`` console script and CMD a subcommand its
parser takes, the exposed ports are the services' defaults (and the metrics ports docker-compose and the chart
give them), the user is the chart's. Built: where a Docker engine answers, scripts/build-image.sh builds the image
and runs it; without one, the same script runs against a stand-in ``docker`` on PATH that records each command
and checks it as the engine would: the build's context and Dockerfile, every COPY source inside the context, the
build arguments the Dockerfile declares, and that the runs name the image just built.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.requirements import require_package

ROOT = Path(__file__).resolve().parents[1]


def _parser(path: Path = ROOT / "Dockerfile"):
    require_package("dockerfile_parse", "pip install dockerfile-parse (the test extra)")
    from dockerfile_parse import DockerfileParser

    return DockerfileParser(path=str(path), cache_content=True)


def _instructions(parser) -> list[tuple[str, str]]:
    return [(i["instruction"], i["value"]) for i in parser.structure if i["instruction"] != "COMMENT"]


def _copy_sources(parser) -> list[str]:
    sources = []
    for instruction, value in _instructions(parser):
        if instruction in ("COPY", "ADD"):
            words = [w for w in shlex.split(value) if not w.startswith("--")]
            sources += words[:-1]  # the last word is the destination
    return sources


def test_base_image_and_instruction_order():
    parser = _parser()
    assert parser.baseimage == "python:3.11-slim" and parser.parent_images == ["python:3.11-slim"]
    kinds = [kind for kind, _ in _instructions(parser)]
    assert kinds[:2] == ["ARG", "FROM"] and kinds.count("FROM") == 1
    assert kinds[-2:] == ["ENTRYPOINT", "CMD"]
    # torch is installed before the sources are copied (a code change keeps that layer), and the package after them
    runs = [i for i, (kind, value) in enumerate(_instructions(parser)) if kind == "RUN"]
    first_copy = kinds.index("COPY")
    torch_run = next(i for i in runs if "torch==" in _instructions(parser)[i][1])
    install_run = next(i for i in runs if 'pip install ".[suffix]"' in _instructions(parser)[i][1])
    assert torch_run < first_copy < install_run
    # suffix decoding's tree is built against that torch (no build isolation: it would fetch another torch)
    arctic_run = next(i for i in runs if "arctic-inference==" in _instructions(parser)[i][1])
    assert torch_run < arctic_run < install_run and "--no-build-isolation" in _instructions(parser)[arctic_run][1]
    assert kinds.index("USER") > install_run  # root only while installing


def test_every_copy_source_exists_and_the_install_has_its_packages():
    parser = _parser()
    sources = _copy_sources(parser)
    missing = [s for s in sources if not (ROOT / s).exists()]
    assert not missing, f"COPY sources not in the build context: {missing}"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    assert set(packages) <= set(sources), f"pip install . needs {packages}; copied: {sources}"
    assert {"pyproject.toml", "README.md", "requirements-models.txt"} <= set(sources)  # read by the RUN after them
    torch_pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch"))
    assert any(torch_pin in value for kind, value in _instructions(parser) if kind == "RUN"), torch_pin


def test_entrypoint_and_cmd_run_the_cli():
    parser = _parser()
    entrypoint = json.loads(dict(_instructions(parser))["ENTRYPOINT"])
    cmd = json.loads(parser.cmd)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entrypoint == ["specdec"] and entrypoint[0] in scripts
    module, _, function = scripts["specdec"].partition(":")
    import importlib

    main = getattr(importlib.import_module(module), function)
    assert callable(main)
    from specdec.entrypoints import cli

    args = cli.build_parser().parse_args(cmd)  # `specdec serve`: a subcommand the CLI takes, no argument needed
    assert cmd == ["serve"] and args is not None


def test_exposed_ports_are_the_services_defaults():
    from draft_service.config import DraftServiceConfig
    from gateway.config import GatewayConfig
    from specdec.entrypoints.serve_config import DEFAULT_HTTP_PORT
    from target_service.config import TargetServiceConfig

    exposed = {int(p.split("/")[0]) for kind, value in _instructions(_parser()) if kind == "EXPOSE"
               for p in value.split()}
    values = yaml.safe_load((ROOT / "helm/specdec/values.yaml").read_text())
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    metrics = {values["draft"]["metricsPort"], values["target"]["metricsPort"],
               int(compose["draft"]["environment"]["SPECDEC_DRAFT_METRICS_PORT"]),
               int(compose["target"]["environment"]["SPECDEC_TARGET_METRICS_PORT"])}
    grpc = {GatewayConfig().port, DraftServiceConfig(model="x").port, TargetServiceConfig(model="x").port}
    assert exposed == grpc | {DEFAULT_HTTP_PORT} | metrics, exposed


def test_runs_as_the_charts_user():
    user = dict(_instructions(_parser()))["USER"]
    values = yaml.safe_load((ROOT / "helm/specdec/values.yaml").read_text())
    run_as = next(v["runAsUser"] for v in _find(values, "runAsUser"))
    assert user.split(":")[0] == str(run_as) != "0"


def _find(tree, key: str):
    if isinstance(tree, dict):
        if key in tree:
            yield tree
        for v in tree.values():
            yield from _find(v, key)
    elif isinstance(tree, list):
        for v in tree:
            yield from _find(v, key)


# --------------------------------------------------------------------------------------------------
# the build

STAND_IN = r'''#!{python}
"""A stand-in for the docker CLI: records each command, checks it as the engine would, and fails like it."""
import json, os, shlex, sys
from pathlib import Path
from dockerfile_parse import DockerfileParser

log = Path(os.environ["STAND_IN_LOG"])
calls = json.loads(log.read_text()) if log.exists() else []
calls.append({{"argv": sys.argv[1:], "cwd": os.getcwd()}})
log.write_text(json.dumps(calls))
args = sys.argv[1:]
if args[:1] == ["build"]:
    opts, i, build_args = {{}}, 1, {{}}
    while i < len(args) - 1:
        if args[i] == "--build-arg":
            name, _, value = args[i + 1].partition("=")
            build_args[name] = value
            i += 2
        elif args[i] in ("--tag", "-t", "--file", "-f", "--network"):
            opts[args[i].lstrip("-")[0]] = args[i + 1]
            i += 2
        else:
            sys.exit(f"stand-in docker: unknown build option {{args[i]}}")
    context = Path(args[-1]).resolve()
    dockerfile = context / opts.get("f", "Dockerfile")
    if not dockerfile.is_file():
        sys.exit(f"unable to prepare context: {{dockerfile}} not found")
    parser = DockerfileParser(path=str(dockerfile))
    declared = {{v.split("=")[0] for i in parser.structure if i["instruction"] == "ARG" for v in [i["value"]]}}
    unknown = set(build_args) - declared
    if unknown:
        sys.exit(f"build-args {{sorted(unknown)}} were not consumed")
    for ins in parser.structure:
        if ins["instruction"] in ("COPY", "ADD"):
            for src in [w for w in shlex.split(ins["value"]) if not w.startswith("--")][:-1]:
                path = (context / src).resolve()
                if context not in (path, *path.parents) or not path.exists():
                    sys.exit(f"COPY failed: {{src}} not found in the build context")
    Path(os.environ["STAND_IN_IMAGES"]).write_text(opts["t"])
    sys.exit(0)
if args[:1] == ["run"]:
    built = Path(os.environ["STAND_IN_IMAGES"])
    words = [w for w in args[1:] if w != "--rm"]
    if words[:1] == ["--entrypoint"]:
        words = words[2:]
    if not built.exists() or words[0] != built.read_text():
        sys.exit(f"Unable to find image {{words[0]}} locally")
    sys.exit(0)
sys.exit(f"stand-in docker: unexpected command {{args}}")
'''


def _engine() -> bool:
    exe = shutil.which("docker")
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "info"], capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _stand_in(tmp_path: Path) -> dict[str, str]:
    require_package("dockerfile_parse", "pip install dockerfile-parse (the test extra)")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    docker.write_text(STAND_IN.format(python=sys.executable))
    docker.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "STAND_IN_LOG": str(tmp_path / "calls.json"),
            "STAND_IN_IMAGES": str(tmp_path / "built")}


def _build(env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts/build-image.sh")], cwd=ROOT / "scripts",
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)


def test_build_script_builds_and_runs_the_image(tmp_path):
    """With an engine: a real build and run (pip inside the build needs the package index: --network host).
    Without: the stand-in checks each command; the build from the repository root, the runs of the image built."""
    image = f"specdec-test:{os.getpid()}"
    if _engine():
        proc = _build({"IMAGE": image}, timeout=3600)
        try:
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
            assert f"built {image}" in proc.stdout
            run = subprocess.run(["docker", "run", "--rm", image, "gateway", "--help"], capture_output=True,
                                 text=True, timeout=300)
            assert run.returncode == 0 and "--draft-addr" in run.stdout, run.stderr[-3000:]
        finally:
            subprocess.run(["docker", "image", "rm", "-f", image], capture_output=True, timeout=120)
        return
    env = {**_stand_in(tmp_path), "IMAGE": image, "BASE_IMAGE": "local/base:bookworm"}
    proc = _build(env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"built {image}" in proc.stdout
    calls = json.loads((tmp_path / "calls.json").read_text())
    build, *runs = calls
    assert build["argv"][0] == "build" and build["argv"][-1] == "." and Path(build["cwd"]) == ROOT
    assert ["--tag", image] == build["argv"][build["argv"].index("--tag"):][:2]
    assert "BASE_IMAGE=local/base:bookworm" in build["argv"] and "host" in build["argv"]
    assert [r["argv"][0] for r in runs] == ["run", "run"] and image in runs[0]["argv"]


def test_the_stand_in_fails_a_broken_build(tmp_path):
    """The stand-in is not a yes-man: a COPY of a missing source, or a build argument the Dockerfile does not
    declare, fails the script, as the engine would."""
    env = {**_stand_in(tmp_path), "IMAGE": "specdec-test:broken"}
    assert _build({**env, "TORCH_INDEX_URL": "https://example.invalid/whl"}, 120).returncode == 0  # declared ARG
    fake = subprocess.run([env["PATH"].split(os.pathsep)[0] + "/docker", "build", "--build-arg", "NOPE=1",
                           "--tag", "x", "."], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True)
    assert fake.returncode != 0 and "NOPE" in fake.stderr
    context = tmp_path / "context"
    context.mkdir()
    (context / "Dockerfile").write_text("FROM scratch\nCOPY not-there ./\n")
    broken = subprocess.run([env["PATH"].split(os.pathsep)[0] + "/docker", "build", "--tag", "x", "."], cwd=context,
                            env={**os.environ, **env}, capture_output=True, text=True)
    assert broken.returncode != 0 and "not-there" in broken.stderr
