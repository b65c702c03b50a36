"""Real service processes and their clients for the served benchmarks (``soak.py``, ``bench_metrics.py``,
``bench_kv_serving.py``): start a part or a whole stack as its own process on free loopback ports, send
HTTP (plain and streamed) and gRPC requests with timing, and read ``/metrics``."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import grpc

from specdec.v1 import generation_service_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"

def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def cpu_info() -> dict:
    """The CPU's model name and the SIMD / matrix flags that decide the speed of a forward pass."""
    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model is None:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"]
    return {"model": model, "cores": len(os.sched_getaffinity(0)), "flags": [f for f in wanted if f in flags]}


class ServiceProc:
    """One ``specdec`` service as a process of its own (a new session), logging to a file; ``start`` waits
    until it is ready (backends: gRPC health SERVING; gateway: HTTP ``/ready`` answers 200)."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, port: int, http_port: int | None = None,
                 metrics_port: int | None = None):
        self.name = name
        self.argv = argv
        self.port = port
        self.http_port = http_port
        self.metrics_port = metrics_port
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.pids: list[int] = []  # every process started (a restart adds one)

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def launch(self) -> "ServiceProc":
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== {time.strftime('%H:%M:%S')} start: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen([sys.executable, "-m", "specdec.entrypoints.cli", *self.argv], cwd=ROOT, env=env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pids.append(self.proc.pid)
        return self

    def wait_ready(self, timeout: float) -> "ServiceProc":
        give_up = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            if self.ready():
                return self
            if time.monotonic() > give_up:
                raise SystemExit(f"{self.name} was not ready within {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.2)

    def ready(self) -> bool:
        if self.http_port is not None:
            try:
                conn = http.client.HTTPConnection(HOST, self.http_port, timeout=5)
                try:
                    conn.request("GET", "/ready")
                    return conn.getresponse().status == 200
                finally:
                    conn.close()
            except OSError:
                return False
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(self.address) as channel:
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
            except grpc.RpcError:
                return False
        return status == health_pb2.HealthCheckResponse.SERVING

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 30.0) -> int | None:
        """Send ``sig`` to the process (only it) and wait for it to end; its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM (the service drains and exits), SIGKILL past ``grace``."""
        if self.proc is not None and self.proc.poll() is None:
            self.kill(signal.SIGTERM, grace)

    def rss(self) -> int | None:
        """Resident set size in bytes (None when the process is not running)."""
        import psutil

        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            return psutil.Process(self.proc.pid).memory_info().rss
        except psutil.Error:
            return None

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


class ProcessStack:
    """Target service, draft service and gateway (gRPC + HTTP) as three processes on loopback ports, the
    backends with ``--metrics-port``. Started together (the gateway waits for its backends)."""

    def __init__(self, target: str, draft: str, *, k: int, log_dir: Path, dtype: str = "float32",
                 draft_dtype: str | None = None, target_threads: int = 0, draft_threads: int = 0,
                 max_batch_size: int = 16, gateway_args: tuple[str, ...] = ()):
        self.log_dir = log_dir
        common = ["--host", HOST, "--max-batch-size", str(max_batch_size)]
        tp, dp = free_port(), free_port()
        self.target = ServiceProc("target", [
            "target-service", "--model", target, "--port", str(tp), "--metrics-port", str(tm := free_port()),
            "--dtype", dtype, "--num-threads", str(target_threads), *common], log_dir, tp, metrics_port=tm)
        self.draft = ServiceProc("draft", [
            "draft-service", "--model", draft, "--port", str(dp), "--metrics-port", str(dm := free_port()),
            "--dtype", draft_dtype or dtype, "--num-threads", str(draft_threads), *common], log_dir, dp, metrics_port=dm)
        gp, hp = free_port(), free_port()
        self.gateway = ServiceProc("gateway", [
            "gateway", "--target-addr", self.target.address, "--draft-addr", self.draft.address, "--host", HOST,
            "--port", str(gp), "--http-port", str(hp), "--num-speculative-tokens", str(k), *gateway_args],
            log_dir, gp, http_port=hp)
        self.procs = [self.target, self.draft, self.gateway]

    def __enter__(self) -> "ProcessStack":
        try:
            for p in self.procs:
                p.launch()
            for p in self.procs:
                p.wait_ready(900)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False

    def stop(self) -> None:
        for p in (self.gateway, self.draft, self.target):
            p.stop()

    def metrics_urls(self) -> dict[str, tuple[int, str]]:
        """name -> (port, path) of every /metrics endpoint: the gateway's HTTP port and the backends' own."""
        return {"gateway": (self.gateway.http_port, "/metrics"), "target": (self.target.metrics_port, "/metrics"),
                "draft": (self.draft.metrics_port, "/metrics")}

    def model_id(self) -> str:
        status, body = http_json(self.gateway.http_port, "GET", "/v1/models", None, 30)
        if status != 200:
            raise SystemExit(f"GET /v1/models answered {status}: {body}")
        return body["data"][0]["id"]


# --------------------------------------------------------------------------------------------------
# /metrics


def get(port: int, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """Every sample of a ``/metrics`` exposition: (sample name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = get(port, "/metrics", 30)
    if status != 200:
        raise RuntimeError(f"GET :{port}/metrics answered {status}")
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def metric(samples: dict, name: str, by: str | None = None, **labels: str) -> float | dict[str, float]:
    """The sum of ``name``'s samples whose labels include ``labels``; grouped by the label ``by`` if given."""
    out: dict[str, float] = defaultdict(float)
    for (n, labs), v in samples.items():
        if n != name:
            continue
        d = dict(labs)
        if all(d.get(k) == v2 for k, v2 in labels.items()):
            out[d.get(by, "") if by else ""] += v
    return dict(out) if by else out.get("", 0.0)


# --------------------------------------------------------------------------------------------------
# clients


@dataclass
class Result:
    kind: str
    protocol: str
    began: float  # monotonic
    outcome: str = "error"  # completed / cancelled / error
    e2e: float | None = None
    ttft: float | None = None
    tokens: int = 0
    error: str | None = None  # its kind, e.g. "HTTP 503", "gRPC UNAVAILABLE"
    detail: str | None = None
    greedy_key: tuple | None = None
    text: str | None = None


class RequestError(Exception):
    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


def http_json(port: int, method: str, path: str, body: dict | None, timeout: float) -> tuple[int, dict | str]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request(method, path, None if body is None else json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw[:500].decode(errors="replace")
    finally:
        conn.close()


def _error_message(body) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body["error"]))[:300]
    return str(body)[:300]


def http_request(port: int, path: str, body: dict, timeout: float, res: Result) -> None:
    """A non-streamed completion or chat completion."""
    try:
        status, out = http_json(port, "POST", path, body, timeout)
    except (TimeoutError, socket.timeout) as exc:
        raise RequestError("client timeout", str(exc)) from None
    except OSError as exc:
        raise RequestError(f"connection {type(exc).__name__}", str(exc)) from None
    if status != 200:
        raise RequestError(f"HTTP {status}", _error_message(out))
    choice = out["choices"][0]
    res.text = choice["text"] if "text" in choice else choice["message"]["content"]
    res.tokens = out["usage"]["completion_tokens"]
    res.e2e = time.monotonic() - res.began
    res.outcome = "completed"


def http_stream(port: int, path: str, body: dict, timeout: float, res: Result, cancel_at: int | None = None,
                count_tokens=None) -> None:
    """An SSE stream; with ``cancel_at``, the client closes the connection once that many tokens arrived
    (counted by re-tokenizing the text: SSE chunks carry text only)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    deadline = res.began + timeout
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RequestError(f"HTTP {resp.status}", _error_message(_loads(resp.read())))
        pieces: list[str] = []
        done = False
        while True:
            if time.monotonic() > deadline:
                raise RequestError("client timeout", f"stream still open after {timeout:.0f} s")
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                err = obj["error"] if isinstance(obj["error"], dict) else {"message": obj["error"]}
                raise RequestError(f"HTTP stream error ({err.get('code') or err.get('type')})", str(err.get("message"))[:300])
            if obj.get("usage"):
                res.tokens = obj["usage"]["completion_tokens"]
            for ch in obj.get("choices", []):
                piece = ch.get("text")
                if piece is None:
                    piece = (ch.get("delta") or {}).get("content")
                if piece:
                    if res.ttft is None:
                        res.ttft = time.monotonic() - res.began
                    pieces.append(piece)
            if cancel_at is not None and pieces and count_tokens("".join(pieces)) >= cancel_at:
                res.tokens = count_tokens("".join(pieces))
                res.text = "".join(pieces)
                res.e2e = time.monotonic() - res.began
                res.outcome = "cancelled"
                return  # closing the connection (finally) is the cancel
        if not done:
            raise RequestError("stream ended without [DONE]", f"{len(pieces)} chunks")
        res.text = "".join(pieces)
        if not res.tokens:
            res.tokens = count_tokens(res.text)
        res.e2e = time.monotonic() - res.began
        res.outcome = "completed"
    except (TimeoutError, socket.timeout) as exc:
        raise RequestError("client timeout", str(exc)) from None
    except (OSError, http.client.HTTPException) as exc:
        raise RequestError(f"connection {type(exc).__name__}", str(exc)) from None
    finally:
        conn.close()


def _loads(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return raw[:300].decode(errors="replace")


def grpc_stream(stub, req: pb.GenerateRequest, timeout: float, res: Result, cancel_at: int | None = None) -> None:
    call = stub.Generate(req, timeout=timeout)
    pieces: list[str] = []
    finished = False
    try:
        for resp in call:
            if resp.token_ids and res.ttft is None:
                res.ttft = time.monotonic() - res.began
            res.tokens += len(resp.token_ids)
            pieces.append(resp.text)
            if resp.finish_reason:
                finished = True
            if cancel_at is not None and res.tokens >= cancel_at:
                call.cancel()
                res.outcome = "cancelled"
                res.e2e = time.monotonic() - res.began
                res.text = "".join(pieces)
                return
    except grpc.RpcError as exc:
        raise RequestError(f"gRPC {exc.code().name}", (exc.details() or "")[:300]) from None
    if not finished:
        raise RequestError("gRPC stream ended without a finish reason", f"{res.tokens} tokens")
    res.text = "".join(pieces)
    res.e2e = time.monotonic() - res.began
    res.outcome = "completed"
