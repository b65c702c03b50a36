"""specdec.serving.logs: text or JSON lines, and progress bars kept out of non-terminal logs."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

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


def _stderr_of(code: str, tmp_path) -> str:
    """What a Python process running ``code`` writes to stderr, a file (not a terminal), with no
    progress-bar settings of its own in the environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    with open(tmp_path / "err.log", "w") as err:
        subprocess.run([sys.executable, "-c", code], stderr=err, check=True, env=env, timeout=120)
    return (tmp_path / "err.log").read_text()


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
    text = _stderr_of(code, tmp_path)
    assert "\r" not in text and "\x1b[A" not in text and "loading" not in text
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert {"message": "hello world", "k": 1}.items() <= lines[-1].items()


def test_tqdm_imported_before_the_logging_set_up_stays_quiet(tmp_path):
    """Every entry point imports tqdm (through transformers) before it configures logging, and tqdm reads
    TQDM_DISABLE only when imported: the bars of a library that uses tqdm directly (transformers' GGUF
    dequantization) must stay out of the log anyway; a caller's explicit ``disable=False`` still wins."""
    code = (
        "import io\n"
        "from tqdm.auto import tqdm\n"
        "import huggingface_hub\n"
        "from specdec.serving.logs import configure_logging\n"
        "configure_logging('INFO', 'json')\n"
        "configure_logging('INFO', 'json')\n"  # twice: no double wrapping
        "for _ in tqdm(range(3), desc='dequantizing'): pass\n"
        "from huggingface_hub.utils import are_progress_bars_disabled\n"
        "assert are_progress_bars_disabled()\n"
        "shown = io.StringIO()\n"
        "for _ in tqdm(range(3), desc='forced', file=shown, disable=False): pass\n"
        "assert 'forced' in shown.getvalue()\n"
    )
    text = _stderr_of(code, tmp_path)
    assert "\r" not in text and "\x1b[A" not in text and "dequantizing" not in text


@pytest.mark.heavy
def test_a_service_started_without_a_terminal_logs_one_json_object_per_line(target_dir):
    """`specdec --log-format json target-service` with stderr to a pipe: every stderr line is a JSON object
    (no progress-bar redraws), with one loading line and one ready line carrying the load time and the
    resident memory as fields."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.service_processes import HOST, ROOT, free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS", "SPECDEC_LOG_FORMAT")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec.entrypoints.cli", "--log-format", "json", "target-service", "--host", HOST,
         "--port", str(port), "--num-threads", "1", "--dtype", "float32", "--model", str(target_dir)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with grpc.insecure_channel(f"{HOST}:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            give_up = time.monotonic() + 180
            while proc.poll() is None and time.monotonic() < give_up:
                try:
                    if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = err.decode()
    assert "\r" not in text and "\x1b[" not in text, text
    lines = [json.loads(line) for line in text.splitlines()]  # every line is a JSON object
    assert all(isinstance(line, dict) and {"time", "level", "logger", "message"} <= line.keys() for line in lines)
    loading = [line for line in lines if line["message"].startswith("target loading ")]
    ready = [line for line in lines if line["message"].startswith("target backend ready in ")]
    assert len(loading) == 1 and len(ready) == 1, text
    assert {"role": "target", "model": str(target_dir), "dtype": "float32", "device": "cpu"}.items() \
        <= loading[0].items()
    ready = ready[0]
    assert ready["role"] == "target" and ready["model"] == str(target_dir)
    assert 0 < ready["load_seconds"] < 180 and ready["resident_bytes"] > ready["weights_bytes"] > 0
    assert "memory at start-up: weights" in ready["message"]
