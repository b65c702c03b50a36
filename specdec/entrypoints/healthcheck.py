"""``python -m specdec.entrypoints.healthcheck HOST:PORT [SERVICE]``: exit 0 when grpc.health.v1 says SERVING.

Used by docker-compose and Kubernetes exec probes (no grpc_health_probe binary needed).
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 3.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            print(f"{address}: {err.code().name}", file=sys.stderr)
            return False
    serving = resp.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}")
    return serving


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m specdec.entrypoints.healthcheck HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    return 0 if check(argv[0], argv[1] if len(argv) > 1 else "") else 1


if __name__ == "__main__":
    sys.exit(main())
