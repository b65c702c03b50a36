"""Logging set-up of every entry point: plain text or one JSON object per line (``--log-format json``),
and progress bars that stay quiet when stderr is not a terminal (container logs)."""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# the attributes every LogRecord has; anything else on a record came from ``extra=`` and is logged as a field
_RECORD_KEYS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the ``extra`` fields, and the exception."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _RECORD_KEYS})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str = "INFO", fmt: str | None = None) -> None:
    """Root logging for a process: ``fmt`` text or json (default: $SPECDEC_LOG_FORMAT, else text)."""
    fmt = (fmt or os.environ.get("SPECDEC_LOG_FORMAT") or "text").lower()
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {list(LOG_FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    if not sys.stderr.isatty():
        quiet_progress_bars()


def quiet_progress_bars() -> None:
    """No progress bars (tqdm's carriage-return and cursor-up redraws are noise in a log file).

    tqdm reads ``TQDM_DISABLE`` and huggingface_hub ``HF_HUB_DISABLE_PROGRESS_BARS`` once, when they are
    imported, and every entry point imports them (through transformers) before its logging is set up: the
    environment covers child processes and later imports, and the libraries already loaded are told
    directly. An operator's own ``TQDM_DISABLE`` / ``HF_HUB_DISABLE_PROGRESS_BARS`` wins."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if os.environ["TQDM_DISABLE"] == "1":
        _disable_imported_tqdm()
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        try:
            from huggingface_hub.utils import disable_progress_bars
        except ImportError:  # pragma: no cover - a transformers dependency
            pass
        else:
            disable_progress_bars()
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    hf_logging.disable_progress_bar()


def _disable_imported_tqdm() -> None:
    """Make ``disable=True`` the default of every tqdm bar (tqdm.auto's and the others subclass tqdm.std's)
    when tqdm was imported before ``TQDM_DISABLE`` was set; a caller that passes ``disable`` still decides."""
    std = sys.modules.get("tqdm.std")
    if std is None or getattr(std.tqdm.__init__, "_specdec_quiet", False):
        return  # imported from now on, tqdm reads TQDM_DISABLE itself
    original = std.tqdm.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("disable", True)
        original(self, *args, **kwargs)

    __init__._specdec_quiet = True
    std.tqdm.__init__ = __init__
