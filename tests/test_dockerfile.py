"""The Dockerfiles (the CPU image: Dockerfile; the GPU image: Dockerfile.gpu), read with a real parser
(dockerfile-parse), and their build (scripts/build-image.sh).

Parsed: the base image (a build argument, BASE_IMAGE), the order of the instructions, no Triton or CUDA wheels in
the CPU image's final stage and a C compiler with Python.h (Triton's launcher) in the GPU image, every COPY source exists and every package
``pip install .`` installs is copied, the entrypoint is the ``specdec`` console script and CMD a subcommand its
parser takes, the exposed ports are the services' defaults (and the metrics ports docker-compose and the chart
give them), the user is the chart's. Built: where a Docker engine answers, scripts/build-image.sh builds the image
and runs it; without one, the same script runs against a stand-in ``docker`` on PATH that records each command
and checks it as the engine would: the build's context and Dockerfile, every COPY source inside the context, the
build arguments the Dockerfile declares, and that the runs name the image just built. The GPU image is built
with the stand-in only (its CUDA base comes from a registry).
"""

from __future__ import annotations

import io
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
CPU, GPU = ROOT / "Dockerfile", ROOT / "Dockerfile.gpu"


def _parser(path: Path = CPU):
    require_package("dockerfile_parse", "pip install dockerfile-parse (the test extra)")
    from dockerfile_parse import DockerfileParser

    # fileobj: with path=, the parser takes any name not ending in "Dockerfile" for a folder
    return DockerfileParser(fileobj=io.BytesIO(path.read_bytes()))


def _instructions(parser) -> list[tuple[str, str]]:
    return [(i["instruction"], i["value"]) for i in parser.structure if i["instruction"] != "COMMENT"]


def _stages(parser) -> list[list[tuple[str, str]]]:
    """The instructions of each stage (from its FROM on); the ARGs before the first FROM are left out."""
    stages: list[list[tuple[str, str]]] = []
    for instruction, value in _instructions(parser):
        if instruction == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((instruction, value))
    return stages


def _runs(instructions) -> str:
    return "\n".join(value for kind, value in instructions if kind == "RUN")


def _copy_sources(parser) -> list[str]:
    """The build context's files the COPYs read (a COPY --from another stage reads none)."""
    sources = []
    for instruction, value in _instructions(parser):
        if instruction in ("COPY", "ADD") and "--from=" not in value:
            words = [w for w in shlex.split(value) if not w.startswith("--")]
            sources += words[:-1]  # the last word is the destination
    return sources


def _install_order(instructions) -> None:
    """torch is installed before the sources are copied (a code change keeps that layer), suffix decoding's tree
    against that torch (no build isolation: it would fetch another torch), the package after the sources."""
    kinds = [kind for kind, _ in instructions]
    runs = [i for i, kind in enumerate(kinds) if kind == "RUN"]
    first_copy = kinds.index("COPY")
    torch_run = next(i for i in runs if "torch==" in instructions[i][1])
    install_run = next(i for i in runs if 'pip install ".[suffix]"' in instructions[i][1])
    assert torch_run < first_copy < install_run
    arctic_run = next(i for i in runs if "arctic-inference==" in instructions[i][1])
    assert torch_run < arctic_run < install_run and "--no-build-isolation" in instructions[arctic_run][1]


def test_base_image_is_a_build_argument():
    """Both images: BASE_IMAGE (a mirror's or a local image, scripts/make-base-image.sh) names every FROM."""
    for path, default in ((CPU, "python:3.11-slim"), (GPU, "nvidia/cuda:")):
        kinds = [kind for kind, _ in _instructions(_parser(path))]
        first = _instructions(_parser(path))[0]
        assert kinds[:2] == ["ARG", "FROM"] and first[1].startswith(f"BASE_IMAGE={default}"), (path.name, first)
        froms = [value.split()[0] for kind, value in _instructions(_parser(path)) if kind == "FROM"]
        assert froms and set(froms) == {"${BASE_IMAGE}"}, (path.name, froms)
        assert kinds[-2:] == ["ENTRYPOINT", "CMD"], path.name


def test_cpu_image_stages_and_instruction_order():
    """Two stages on one base: `build` (compilers, the venv) and the runtime, which copies the venv and runs."""
    parser = _parser()
    assert parser.baseimage == "python:3.11-slim" and parser.parent_images == ["python:3.11-slim"] * 2
    build, runtime = _stages(parser)
    assert build[0] == ("FROM", "${BASE_IMAGE} AS build") and runtime[0] == ("FROM", "${BASE_IMAGE}")
    _install_order(build)
    kinds = [kind for kind, _ in runtime]
    copies = [value for kind, value in runtime if kind == "COPY"]
    assert copies == ["--from=build /opt/venv /opt/venv"], copies  # the runtime has no sources, only the venv
    assert "pip install" not in _runs(runtime), "the runtime stage installs nothing with pip"
    assert kinds.index("USER") > kinds.index("COPY")  # root only while installing
    env = " ".join(value for kind, value in runtime if kind == "ENV")
    assert "PATH=/opt/venv/bin:" in env and "SPECDEC_CACHE=/cache" in env


def test_cpu_image_has_no_triton_or_cuda():
    """Triton (~1 GB with its CUDA toolchain; a dependency of the package and of xgrammar) is removed in the layer
    that installs it, the build fails if it or an NVIDIA wheel is left, torch comes from the CPU wheels, and the
    runtime keeps a C compiler (the CPU attention kernel, kernels/csrc, is built on first use)."""
    build, runtime = _stages(_parser())
    install = next(value for kind, value in build if kind == "RUN" and 'pip install ".[suffix]"' in value)
    assert install.index('pip install ".[suffix]"') < install.index("pip uninstall -y triton"), install
    assert "grep -iE '^(triton|nvidia-" in install and "exit 1" in install, "no check that Triton/CUDA are gone"
    assert "torch.version.cuda is None" in install
    torch_arg = next(value for kind, value in build if kind == "ARG" and value.startswith("TORCH_INDEX_URL="))
    assert torch_arg.endswith("/whl/cpu"), torch_arg
    assert "triton" not in _runs(runtime) and "nvidia" not in _runs(runtime).lower()
    apt = next(value for kind, value in runtime if kind == "RUN" and "apt-get install" in value)
    assert "gcc" in apt.split() and "libc6-dev" in apt.split() and "g++" not in apt.split()  # g++: build only


def test_gpu_image_can_build_tritons_launcher():
    """The GPU image: torch's CUDA wheels, Triton kept, gcc and Python.h (python3-dev) for the launcher Triton
    compiles at run time, Triton's cache on the /cache volume (the root filesystem can be read-only), and what
    scripts/gpu-check.sh runs copied in."""
    parser = _parser(GPU)
    assert parser.baseimage.startswith("nvidia/cuda:") and not parser.is_multistage
    instructions = _instructions(parser)
    _install_order(instructions)
    runs = _runs(instructions)
    apt = next(value for kind, value in instructions if kind == "RUN" and "apt-get install" in value).split()
    assert {"gcc", "python3-dev", "python3-venv", "libc6-dev"} <= set(apt), apt
    assert "uninstall -y triton" not in runs and "import os, shutil, sysconfig, triton" in runs
    assert "shutil.which('gcc')" in runs and "Python.h" in runs
    torch_arg = next(value for kind, value in instructions if kind == "ARG" and value.startswith("TORCH_INDEX_URL="))
    assert "/whl/cu" in torch_arg, torch_arg
    env = " ".join(value for kind, value in instructions if kind == "ENV")
    assert "TRITON_CACHE_DIR=/cache/" in env and "TRITON_HOME=/cache" in env and "SPECDEC_CACHE=/cache" in env
    gpu_check = (ROOT / "scripts/gpu-check.sh").read_text()
    sources = _copy_sources(parser)
    for needed in ("scripts", "tests", "benchmarks", "requirements-models.txt", "pyproject.toml"):
        assert needed in sources, f"scripts/gpu-check.sh needs {needed}"
    for path in ("tests/kernels", "tests/specdec", "benchmarks/bench_kernels.py", "requirements-models.txt"):
        assert path in gpu_check and (ROOT / path).exists(), path
    kinds = [kind for kind, _ in instructions]
    install_run = next(i for i, (kind, value) in enumerate(instructions) if 'pip install ".[suffix]"' in value)
    assert kinds.index("USER") > install_run


@pytest.mark.parametrize("path", [CPU, GPU], ids=["cpu", "gpu"])
def test_every_line_is_an_instruction_or_a_comment(path):
    """What Docker's parser takes: a line that is neither (a comment's continuation without ``#``) stops the
    build with "unknown instruction"; dockerfile-parse is more lenient, so each logical line is checked here."""
    known = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
             "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}
    continued = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if not continued and stripped and not stripped.startswith("#"):
            assert stripped.split()[0].upper() in known, f"{path.name}:{number}: not an instruction: {line!r}"
        if not stripped.startswith("#"):
            continued = stripped.endswith("\\")


@pytest.mark.parametrize("path", [CPU, GPU], ids=["cpu", "gpu"])
def test_every_copy_source_exists_and_the_install_has_its_packages(path):
    parser = _parser(path)
    sources = _copy_sources(parser)
    missing = [s for s in sources if not (ROOT / s).exists()]
    assert not missing, f"COPY sources not in the build context: {missing}"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    assert set(packages) <= set(sources), f"pip install . needs {packages}; copied: {sources}"
    assert {"pyproject.toml", "README.md", "requirements-models.txt"} <= set(sources)  # read by the RUN after them
    torch_pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch"))
    assert any(torch_pin in value for kind, value in _instructions(parser) if kind == "RUN"), torch_pin
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not set(sources) & set(ignored), "a COPY source is excluded from the context by .dockerignore"
    assert ".git" in ignored


@pytest.mark.parametrize("path", [CPU, GPU], ids=["cpu", "gpu"])
def test_entrypoint_and_cmd_run_the_cli(path):
    parser = _parser(path)
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


@pytest.mark.parametrize("path", [CPU, GPU], ids=["cpu", "gpu"])
def test_exposed_ports_are_the_services_defaults(path):
    from draft_service.config import DraftServiceConfig
    from gateway.config import GatewayConfig
    from specdec.entrypoints.serve_config import DEFAULT_HTTP_PORT
    from target_service.config import TargetServiceConfig

    exposed = {int(p.split("/")[0]) for kind, value in _instructions(_parser(path)) if kind == "EXPOSE"
               for p in value.split()}
    values = yaml.safe_load((ROOT / "helm/specdec/values.yaml").read_text())
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    metrics = {values["draft"]["metricsPort"], values["target"]["metricsPort"],
               int(compose["draft"]["environment"]["SPECDEC_DRAFT_METRICS_PORT"]),
               int(compose["target"]["environment"]["SPECDEC_TARGET_METRICS_PORT"])}
    grpc = {GatewayConfig().port, DraftServiceConfig(model="x").port, TargetServiceConfig(model="x").port}
    assert exposed == grpc | {DEFAULT_HTTP_PORT} | metrics, exposed


@pytest.mark.parametrize("path", [CPU, GPU], ids=["cpu", "gpu"])
def test_runs_as_the_charts_user_with_the_cache_on_a_volume(path):
    instructions = _instructions(_parser(path))
    user = dict(instructions)["USER"]
    values = yaml.safe_load((ROOT / "helm/specdec/values.yaml").read_text())
    run_as = next(v["runAsUser"] for v in _find(values, "runAsUser"))
    assert user.split(":")[0] == str(run_as) != "0"
    assert json.loads(dict(instructions)["VOLUME"]) == ["/cache"]
    assert f"chown {run_as}:{run_as} /cache" in _runs(instructions)


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
import io, json, os, shlex, sys
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
    parser = DockerfileParser(fileobj=io.BytesIO(dockerfile.read_bytes()))
    declared = {{v.split("=")[0] for i in parser.structure if i["instruction"] == "ARG" for v in [i["value"]]}}
    unknown = set(build_args) - declared
    if unknown:
        sys.exit(f"build-args {{sorted(unknown)}} were not consumed")
    stages = []
    for ins in parser.structure:
        if ins["instruction"] == "FROM":
            words = ins["value"].split()
            stages.append(words[2] if len(words) == 3 and words[1].lower() == "as" else None)
        if ins["instruction"] == "COPY" and "--from=" in ins["value"]:
            stage = ins["value"].split("--from=")[1].split()[0]
            if stage not in stages[:-1]:
                sys.exit(f"COPY --from={{stage}}: no such earlier stage")
        if ins["instruction"] in ("COPY", "ADD") and "--from=" not in ins["value"]:
            for src in [w for w in shlex.split(ins["value"]) if not w.startswith("--")][:-1]:
                path = (context / src).resolve()
                if context not in (path, *path.parents) or not path.exists():
                    sys.exit(f"COPY failed: {{src}} not found in the build context")
    for url in build_args.get("PIP_FIND_LINKS", "").split():
        if url.startswith(("http://127.0.0.1:", "http://localhost:")):  # the host's, for the build (--network host)
            import urllib.request
            try:
                urllib.request.urlopen(url, timeout=10).read()
            except OSError as exc:
                sys.exit(f"pip: Could not fetch URL {{url}}: {{exc}}")
    Path(os.environ["STAND_IN_IMAGES"]).write_text(opts["t"])
    sys.exit(0)
if args[:2] == ["image", "inspect"]:
    built = Path(os.environ["STAND_IN_IMAGES"])
    if not built.exists() or args[-1] != built.read_text():
        sys.exit(f"Error: No such image: {{args[-1]}}")
    print(1234567890 if "--format" in args else json.dumps([{{"RepoTags": [args[-1]]}}]))
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
    import socket

    with socket.socket() as s:  # where build-image.sh serves the host's pip folders (PIP_FIND_LINKS=/opt/wheels)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "STAND_IN_LOG": str(tmp_path / "calls.json"),
            "STAND_IN_IMAGES": str(tmp_path / "built"), "SERVE_PORT": str(port)}


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


def test_build_script_builds_the_gpu_image_with_the_stand_in(tmp_path):
    """DOCKERFILE=Dockerfile.gpu: the same script builds the GPU image (its CUDA base needs a registry, so the
    stand-in checks it everywhere) and expects Triton in it; the CPU image is checked to have none."""
    env = {**_stand_in(tmp_path), "BASE_IMAGE": "mirror.local/nvidia/cuda:12.8.1-base-ubuntu24.04",
           "DOCKERFILE": "Dockerfile.gpu", "PIP_FIND_LINKS": "http://mirror.local/wheels/ /not/a/folder"}
    proc = _build(env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "built specdec-gpu:local" in proc.stdout
    build, help_run, import_run = json.loads((tmp_path / "calls.json").read_text())
    argv = build["argv"]
    assert argv[argv.index("--file") + 1] == "Dockerfile.gpu" and argv[argv.index("--tag") + 1] == "specdec-gpu:local"
    assert "PIP_FIND_LINKS=http://mirror.local/wheels/" in argv  # no such folder here: left out
    assert "bool(1)" in import_run["argv"][-1]  # Triton expected in the GPU image
    cpu = tmp_path / "cpu"
    cpu.mkdir()
    env = {**_stand_in(cpu), "IMAGE": "specdec-test:cpu"}
    assert _build(env, timeout=120).returncode == 0
    *_, import_run = json.loads((cpu / "calls.json").read_text())
    assert "bool(0)" in import_run["argv"][-1]  # and none in the CPU image
