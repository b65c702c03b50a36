"""scripts/image-e2e.sh: the CPU image built, the compose stack's specdec services started on it, one completion,
the services' /metrics, and the stack torn down (on failure too).

Where a Docker engine answers (``docker info``), the slow test runs the script for real (a local base image from
scripts/make-base-image.sh: BASE_IMAGE; TORCH_INDEX_URL/PIP_* pass through from the environment).
Without one (CI runners start no engine), and always in the other tests, the script runs against stand-in
``docker`` (tests/test_dockerfile.py's: it checks the build's context, Dockerfile and arguments) and
``docker-compose`` executables on PATH: the stand-in compose checks its files and the services it is asked to
start, refuses an image that was not built, and `up` starts a stand-in gateway (an HTTP server answering
/v1/models, /v1/completions and /metrics) that `down` stops.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_dockerfile import ROOT, _engine, _stand_in

COMPOSE = r'''#!{python}
"""A stand-in for docker-compose: records each command and checks it as compose would."""
import json, os, signal, subprocess, sys
from pathlib import Path
import yaml

log = Path(os.environ["STAND_IN_LOG"])
calls = json.loads(log.read_text()) if log.exists() else []
calls.append({{"argv": ["docker-compose", *sys.argv[1:]], "cwd": os.getcwd()}})
log.write_text(json.dumps(calls))
args, files, i = sys.argv[1:], [], 0
while i < len(args) and args[i].startswith("-"):
    if args[i] in ("-f", "--file"):
        files.append(args[i + 1])
    elif args[i] not in ("-p", "--project-name"):
        sys.exit(f"stand-in docker-compose: unknown option {{args[i]}}")
    i += 2
command, rest = args[i], args[i + 1:]
services = {{}}
for name in files or ["docker-compose.yml"]:
    path = Path(name)
    if not path.is_file():
        sys.exit(f"ERROR: .FileNotFoundError: {{name}}")
    for svc, spec in (yaml.safe_load(path.read_text()).get("services") or {{}}).items():
        services.setdefault(svc, {{}}).update(spec)
pidfile = Path(os.environ["STAND_IN_GATEWAY_PID"])
if command in ("config", "ps", "logs"):
    sys.exit(0)
if command == "up":
    names = [w for w in rest if not w.startswith("-")]
    if "-d" not in rest or not names or set(names) - set(services):
        sys.exit(f"stand-in docker-compose: up {{rest}}; services: {{sorted(services)}}")
    built = Path(os.environ["STAND_IN_IMAGES"])
    for name in names:
        if services[name].get("image") != (built.read_text() if built.exists() else None):
            sys.exit(f"ERROR: pull access denied for {{services[name].get('image')}}")
        if not services[name].get("read_only"):
            sys.exit(f"stand-in docker-compose: {{name}} has a writable root filesystem")
    if "gateway" in names and os.environ.get("STAND_IN_GATEWAY"):
        proc = subprocess.Popen([sys.executable, os.environ["STAND_IN_GATEWAY"]], start_new_session=True)
        pidfile.write_text(str(proc.pid))
    sys.exit(0)
if command == "exec":
    if rest[:1] != ["-T"] or rest[1] not in services:
        sys.exit(f"stand-in docker-compose: exec {{rest}}")
    sys.exit(0)
if command == "down":
    if pidfile.exists():
        os.kill(int(pidfile.read_text()), signal.SIGTERM)
        pidfile.unlink()
    sys.exit(0)
sys.exit(f"stand-in docker-compose: unexpected command {{command}}")
'''

GATEWAY = r'''
"""A stand-in gateway: the OpenAI routes and /metrics the e2e script calls; each request recorded."""
import json, os
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

seen = Path(os.environ["STAND_IN_REQUESTS"])

class Handler(BaseHTTPRequestHandler):
    def _send(self, body, kind="application/json"):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self, body=None):
        with seen.open("a") as f:
            f.write(json.dumps([self.command, self.path, body]) + "\n")

    def do_GET(self):
        self._record()
        if self.path == "/v1/models":
            return self._send({"object": "list", "data": [{"id": "smollm2-135m", "object": "model"}]})
        if self.path == "/metrics":
            return self._send("# TYPE specdec_requests_total counter\nspecdec_requests_total 1.0\n", "text/plain")
        self.send_error(404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._record(body)
        text = os.environ.get("STAND_IN_TEXT", " Paris.")
        self._send({"object": "text_completion", "choices": [{"index": 0, "text": text}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 2}})

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", int(os.environ["HTTP_PORT"])), Handler).serve_forever()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stand_ins(tmp_path: Path, serve: bool = True) -> dict[str, str]:
    env = _stand_in(tmp_path)  # docker, on PATH
    compose = tmp_path / "bin" / "docker-compose"
    compose.write_text(COMPOSE.format(python=sys.executable))
    compose.chmod(0o755)
    gateway = tmp_path / "gateway.py"
    gateway.write_text(GATEWAY)
    return {**env, "STAND_IN_GATEWAY": str(gateway) if serve else "", "STAND_IN_GATEWAY_PID": str(tmp_path / "pid"),
            "STAND_IN_REQUESTS": str(tmp_path / "requests.jsonl"), "HTTP_PORT": str(_free_port()),
            "IMAGE": "specdec-e2e-test:stand-in", "STARTUP_TIMEOUT": "30",
            "COMPOSE_PROJECT_NAME": f"specdec-e2e-test-{os.getpid()}"}


def _compose_command(argv: list[str]) -> list[str]:
    """docker-compose's command and its arguments, after the global options (-f FILE, --project-name NAME)."""
    i = 1
    while argv[i].startswith("-"):
        i += 2
    return argv[i:]


def _e2e(env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts/image-e2e.sh")], cwd=ROOT / "scripts",
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)


def _check_stand_in_run(tmp_path: Path, env: dict[str, str]) -> None:
    proc = _e2e(env, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [c["argv"] for c in json.loads((tmp_path / "calls.json").read_text())]
    docker = [c for c in calls if c[0] != "docker-compose"]
    compose = [_compose_command(c) for c in calls if c[0] == "docker-compose"]
    # the image built (scripts/build-image.sh: the CPU Dockerfile, its runs) before compose starts anything
    assert docker[0][0] == "build" and docker[0][docker[0].index("--file") + 1] == "Dockerfile"
    assert env["IMAGE"] in docker[0] and [c[0] for c in docker[1:3]] == ["run", "run"]
    assert docker[3][:2] == ["image", "inspect"]
    assert calls.index(docker[3]) < next(i for i, c in enumerate(calls) if c[0] == "docker-compose")
    # compose: the repository's file plus the override naming the image, up the three services, down -v last
    first = next(c for c in calls if c[0] == "docker-compose")
    assert first[first.index("-f") + 1] == "docker-compose.yml"
    up = next(c for c in compose if c[0] == "up")
    assert up[:3] == ["up", "-d", "--no-build"] and sorted(up[3:]) == ["draft", "gateway", "target"]
    assert compose[-1][:2] == ["down", "-v"]
    assert [c for c in compose if c[0] == "exec"] == [
        ["exec", "-T", "gateway", "python", "-c", c[-1]] for c in compose if c[0] == "exec"]
    assert len([c for c in compose if c[0] == "exec"]) == 2  # the draft's and the target's /metrics
    # the stand-in gateway got the completion and the scrape, and was stopped by `down`
    requests = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    posts = [r for r in requests if r[0] == "POST"]
    assert posts and posts[0][1] == "/v1/completions" and posts[0][2]["model"] == "smollm2-135m"
    assert ["GET", "/metrics", None] in requests
    assert not (tmp_path / "pid").exists()
    for line in ("e2e: build_seconds=", "e2e: cold_start_seconds=", "e2e: image=", "e2e: ok"):
        assert line in proc.stdout, proc.stdout


@pytest.mark.slow
def test_image_e2e(tmp_path):
    """With an engine: the real build, stack, completion and scrape (slow: the build takes many minutes cold).
    Without: the same script against the stand-ins."""
    if _engine():
        env = {"COMPOSE_PROJECT_NAME": f"specdec-e2e-test-{os.getpid()}"}
        proc = _e2e(env, timeout=5400)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
        assert "e2e: ok" in proc.stdout and "e2e: cold_start_seconds=" in proc.stdout
        return
    _check_stand_in_run(tmp_path, _stand_ins(tmp_path))


def test_image_e2e_with_stand_ins(tmp_path):
    """The script's commands, in order, checked by the stand-ins (fast: it runs everywhere), with a folder of
    wheels on the host (PIP_FIND_LINKS) served to the build over the host's loopback while it runs."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    port = _free_port()
    env = {**_stand_ins(tmp_path), "PIP_FIND_LINKS": f"{wheels} https://mirror.local/wheels/ /not/a/folder",
           "SERVE_PORT": str(port), "BASE_IMAGE": "specdec-base:bookworm", "TORCH_INDEX_URL": ""}
    _check_stand_in_run(tmp_path, env)
    build = json.loads((tmp_path / "calls.json").read_text())[0]["argv"]
    assert "BASE_IMAGE=specdec-base:bookworm" in build and "TORCH_INDEX_URL=" in build
    links = next(a for a in build if a.startswith("PIP_FIND_LINKS="))
    # the host's folder served (the stand-in fetched it during the build), a URL kept, a missing folder left out
    assert links == f"PIP_FIND_LINKS=http://127.0.0.1:{port}/0/ https://mirror.local/wheels/", links


@pytest.mark.heavy
@pytest.mark.parametrize("failure", ["no-gateway", "empty-text"])
def test_image_e2e_tears_down_on_failure(tmp_path, failure):
    """A stack that does not answer, or an empty completion: the script fails, and the stack is still taken down
    (the services' logs printed, then `down -v`)."""
    env = {**_stand_ins(tmp_path, serve=failure != "no-gateway"), "STARTUP_TIMEOUT": "4"}
    if failure == "empty-text":
        env["STAND_IN_TEXT"] = "  "
    proc = _e2e(env, timeout=120)
    assert proc.returncode != 0 and "e2e: ok" not in proc.stdout, proc.stdout
    compose = [_compose_command(c["argv"]) for c in json.loads((tmp_path / "calls.json").read_text())
               if c["argv"][0] == "docker-compose"]
    assert any(c[0] == "up" for c in compose) and compose[-1][:2] == ["down", "-v"], compose
    assert any(c[0] == "logs" for c in compose)
    assert not (tmp_path / "pid").exists()  # the stand-in gateway was stopped
    assert ("empty completion" if failure == "empty-text" else "no completion within 4s") in proc.stderr


def test_image_e2e_without_the_image_starts_nothing(tmp_path):
    """SKIP_BUILD=1 and no such image: the script stops before compose starts anything."""
    env = {**_stand_ins(tmp_path), "SKIP_BUILD": "1"}
    proc = _e2e(env, timeout=60)
    assert proc.returncode != 0 and "No such image" in proc.stderr
    calls = [c["argv"] for c in json.loads((tmp_path / "calls.json").read_text())]
    assert calls == [["image", "inspect", "--format", "{{.Size}}", env["IMAGE"]]], calls


def test_make_base_image_script_is_valid_bash_and_imports_a_debootstrap():
    """scripts/make-base-image.sh (the local base where no registry answers; run for real where an engine and
    root are: it was, to make the base the e2e run used): it parses, debootstraps minbase with python3 and its
    venv module, and imports the tree with `docker import`."""
    script = ROOT / "scripts/make-base-image.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates" in text
    assert "docker import" in text and 'BASE_IMAGE="${BASE_IMAGE:-specdec-base:bookworm}"' in text
