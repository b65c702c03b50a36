"""The package's interface to the ``specdec`` command line."""

from __future__ import annotations

import subprocess
import sys


def test_package_exposes_the_command_without_importing_torch():
    """``specdec COMMAND`` imports specdec.distill for add_arguments whatever the command; run and distill
    (and torch with them) are imported on first use."""
    code = ("import sys, specdec.distill as D; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert callable(D.add_arguments) and D.DistillConfig().out == 'draft'; "
            "from specdec.distill import train; assert D.run is train.run and D.distill is train.distill")
    subprocess.run([sys.executable, "-c", code], check=True)
