"""specdec.entrypoints.healthcheck: the exec probe containers run every few seconds."""

from __future__ import annotations

import subprocess
import sys


def test_the_probe_does_not_import_torch_or_transformers():
    """A probe that imports torch takes ~2 s of a 5 s probe timeout; specdec's package imports are lazy."""
    code = ("import sys, specdec.entrypoints.healthcheck; "
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy; import specdec; assert specdec.SamplingParams.__name__ == 'SamplingParams'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_probe_reports_an_unreachable_service(capsys):
    from specdec.entrypoints.healthcheck import main

    assert main(["127.0.0.1:1"]) != 0
    assert "127.0.0.1:1" in capsys.readouterr().err
