"""Draft and target services as real separate processes (``python -m target_service ...``), for tests
that kill them with real signals and start them again on the same port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServiceProcess:
    """One service process; ``start`` waits until its health says SERVING (the model is loaded)."""

    def __init__(self, module: str, args: list[str], log_dir: Path, port: int | None = None):
        self.module = module
        self.args = args
        self.port = port or free_port()
        self.log_path = log_dir / f"{module}-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self, timeout: float = 120.0) -> "ServiceProcess":
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, "--host", HOST, "--port", str(self.port), "--num-threads", "1",
                 "--dtype", "float32", *self.args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        channel = grpc.insecure_channel(self.address)
        try:
            health = health_pb2_grpc.HealthStub(channel)
            give_up = time.monotonic() + timeout
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.module} exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
                if time.monotonic() > give_up:
                    raise TimeoutError(f"{self.module} on :{self.port} did not serve within {timeout} s:\n{self.log()}")
                time.sleep(0.1)
        finally:
            channel.close()

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 30.0) -> int:
        """Send ``sig`` and wait for the process to end; its exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""


def service_pair(target_dir, draft_dir, logs: Path):
    """A target and a draft service process on the given model folders; yields (target, draft) and
    kills both at the end (a generator for a module-scoped fixture)."""
    target = ServiceProcess("target_service", ["--model", str(target_dir)], logs).start()
    draft = ServiceProcess("draft_service", ["--model", str(draft_dir)], logs).start()
    try:
        yield target, draft
    finally:
        for proc in (target, draft):
            proc.kill()
