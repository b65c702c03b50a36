"""``specdec draft-service`` / ``python -m draft_service``: run the draft service alone (what a container runs)."""

from __future__ import annotations

import argparse
import logging
import sys

from draft_service.config import ENV_PREFIX, DraftServiceConfig
from specdec import settings


def add_arguments(p: argparse.ArgumentParser) -> None:
    settings.add_arguments(p, DraftServiceConfig, ENV_PREFIX)


def run(args: argparse.Namespace) -> int:
    from draft_service.server import create_server
    from specdec.grpc_utils import serve_until_signal

    config = settings.from_args(DraftServiceConfig, args)
    handle = create_server(config, load_async=True)
    logging.getLogger(__name__).info("draft service on %s:%d (NOT_SERVING until the model is loaded)", config.host, handle.port)
    serve_until_signal(handle)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="draft_service")
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(run(parser.parse_args()))
