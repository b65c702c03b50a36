"""specdec.serving.logs: text or JSON lines, and progress bars kept out of non-terminal logs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from specdec.serving.logs import JsonFormatter, configure_logging


def test_json_lines_carry_the_extra_fields():
    record = logging.LogRecord("specdec.requests", logging.INFO, __file__, 1, "request %s finished", ("r1",), None)
    record.prompt_tokens = 5
    record.acceptance_rate = 0.5
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "request r1 finished" and line["level"] == "INFO"
    assert line["logger"] == "specdec.requests" and line["time"].endswith("Z")
    assert (line["prompt_tokens"], line["acceptance_rate"]) == (5, 0.5)
    assert "args" not in line and "msg" not in line


def test_exceptions_are_one_json_line():
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = JsonFormatter().format(record)
    assert "\n" not in line and "ValueError: boom" in json.loads(line)["exception"]


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="json"):
        configure_logging("INFO", "yaml")


def test_a_process_without_a_terminal_logs_json_and_no_progress_bars(tmp_path):
    """What a container sees: `specdec ... --log-format json` with stderr to a file -> every line is
    JSON and no tqdm redraw (carriage returns, cursor-up) reaches the log."""
    code = (
        "from specdec.serving.logs import configure_logging\n"
        "configure_logging('INFO', 'json')\n"
        "import logging, tqdm\n"
        "logging.getLogger('specdec.test').info('hello %s', 'world', extra={'k': 1})\n"
        "for _ in tqdm.tqdm(range(3), desc='loading'): pass\n"
        "from transformers.utils import logging as hf\n"
        "assert not hf.is_progress_bar_enabled()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    with open(tmp_path / "err.log", "w") as err:
        subprocess.run([sys.executable, "-c", code], stderr=err, check=True, env=env, timeout=120)
    text = (tmp_path / "err.log").read_text()
    assert "\r" not in text and "\x1b[A" not in text and "loading" not in text
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert {"message": "hello world", "k": 1}.items() <= lines[-1].items()
