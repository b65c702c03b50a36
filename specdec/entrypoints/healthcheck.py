"""``python -m specdec.entrypoints.healthcheck HOST:PORT [SERVICE]``: exit 0 when grpc.health.v1 says SERVING.

Used by docker-compose and Kubernetes exec probes (no grpc_health_probe binary needed). Against a TLS
server give ``--tls-ca-file`` (the CA that signed the server's certificate), under mutual TLS also
``--tls-cert-file`` / ``--tls-key-file``, and ``--tls-server-name`` when the certificate does not name
the probed host (a container probing ``localhost``). Each flag also reads ``SPECDEC_HEALTHCHECK_<FLAG>``.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.errors import ConfigError
from specdec.serving.tls import PLAINTEXT, ChannelSecurity, channel_security

ENV_PREFIX = "SPECDEC_HEALTHCHECK"
_TLS_FLAGS = {
    "tls_ca_file": "PEM CA bundle that signed the server's certificate: probe over TLS",
    "tls_cert_file": "PEM client certificate, for a mutual-TLS server",
    "tls_key_file": "PEM private key of --tls-cert-file",
    "tls_server_name": "name the server's certificate carries, when it is not HOST (e.g. probing localhost)",
}


def check(address: str, service: str = "", timeout: float = 3.0, security: ChannelSecurity = PLAINTEXT) -> bool:
    with security.channel(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            print(f"{address}: {err.code().name}", file=sys.stderr)
            return False
    serving = resp.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}")
    return serving


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specdec.entrypoints.healthcheck",
                                description="exit 0 when the gRPC server's health says SERVING")
    p.add_argument("address", metavar="HOST:PORT")
    p.add_argument("service", nargs="?", default="", help="service name to check (default: the server as a whole)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    for name, help_text in _TLS_FLAGS.items():
        env = f"{ENV_PREFIX}_{name.upper()}"
        p.add_argument("--" + name.replace("_", "-"), default=os.environ.get(env) or None, help=f"{help_text} (env {env})")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        security = channel_security(args.tls_ca_file, args.tls_cert_file, args.tls_key_file, args.tls_server_name,
                                    flag_prefix="--tls")
    except ConfigError as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 2
    return 0 if check(args.address, args.service, args.timeout, security) else 1


if __name__ == "__main__":
    sys.exit(main())
