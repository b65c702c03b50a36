"""``specdec`` command line. Each subcommand lives in its own module and is imported lazily."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from specdec.serving.logs import LOG_FORMATS, configure_logging

# name -> (module, help). The module provides add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("specdec.entrypoints.serve", "serve draft, target and gateway on this machine (like vllm serve)"),
    "draft-service": ("draft_service.__main__", "run the draft service alone"),
    "target-service": ("target_service.__main__", "run the target service alone"),
    "gateway": ("gateway.__main__", "run the gateway alone, against running draft and target services"),
    "bench": ("specdec.entrypoints.bench", "load a running server's OpenAI API: throughput, TTFT / ITL / e2e "
                                           "percentiles, acceptance (like vllm bench serve)"),
    "generate": ("specdec.entrypoints.generate", "generate offline with the LLM API (prints text and speculation stats)"),
    "distill": ("specdec.distill", "train a small draft for a target by knowledge distillation"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding.")
    parser.add_argument("--log-level", default=os.environ.get("SPECDEC_LOG_LEVEL", "INFO"),
                        help="logging level (env SPECDEC_LOG_LEVEL; default INFO)")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=os.environ.get("SPECDEC_LOG_FORMAT", "text"),
                        help="text, or one JSON object per line (env SPECDEC_LOG_FORMAT; default text)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    from specdec.errors import SpecDecError

    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except SpecDecError as exc:  # a user's mistake: one clear line, no stack trace
        print(f"specdec {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
