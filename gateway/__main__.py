"""``specdec gateway`` / ``python -m gateway``: run the gateway alone against draft/target services."""

from __future__ import annotations

import argparse
import logging
import sys

from gateway.config import ENV_PREFIX, GatewayConfig
from specdec import settings


def add_arguments(p: argparse.ArgumentParser) -> None:
    settings.add_arguments(p, GatewayConfig, ENV_PREFIX)


def run(args: argparse.Namespace) -> int:
    from gateway.server import create_server
    from specdec.grpc_utils import serve_until_signal

    config = settings.from_args(GatewayConfig, args)
    handle = create_server(config)
    logging.getLogger(__name__).info("gateway GenerationService on %s:%d", config.host, handle.port)
    serve_until_signal(handle)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="gateway")
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(run(parser.parse_args()))
