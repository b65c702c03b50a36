"""tests/conftest.py's rule: under CI (``CI=1``) a skipped test is a failure naming its reason, except a test that
needs a CUDA GPU. A tiny test file runs through pytest twice, with the suite's conftest as a plugin: without CI
its skips stay skips; with CI=1 the same skips fail, and the GPU ones alone still skip."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

TESTS = '''
import pytest

def test_runs():
    assert 1 + 1 == 2

def test_skips_in_the_body():
    pytest.skip("pip package for module 'x' is not installed")

@pytest.mark.skipif(True, reason="no C compiler here")
def test_skipif_marker():
    pass

@pytest.fixture
def needs_something():
    pytest.skip("a fixture's requirement is missing")

def test_skips_in_a_fixture(needs_something):
    pass

def test_needs_a_gpu_by_reason():
    pytest.skip("needs a CUDA GPU (scripts/gpu-check.sh runs these)")

@pytest.mark.cuda
def test_marked_cuda():
    assert __import__("torch").cuda.is_available()

@pytest.mark.xfail(reason="a known bug", strict=True)
def test_expected_failure():
    assert False
'''

INI = "[pytest]\nmarkers =\n    cuda: needs a CUDA GPU\n"


def _outcomes(tmp_path: Path, ci: str | None) -> dict[str, tuple[str, str]]:
    """{test name: (outcome, message)} from a pytest run of TESTS with tests/conftest.py as a plugin."""
    (tmp_path / "test_tiny.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text(INI)
    xml = tmp_path / f"report-{ci}.xml"
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if ci is not None:
        env["CI"] = ci
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           f"--junitxml={xml}", "test_tiny.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert xml.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        children = [c for c in case if c.tag in ("failure", "error", "skipped")]
        tag = children[0].tag if children else "passed"
        message = (children[0].get("message") or "") + (children[0].text or "") if children else ""
        out[case.get("name")] = (tag, message)
    return out


GPU = torch.cuda.is_available()


@pytest.mark.heavy
def test_without_ci_skips_stay_skips(tmp_path):
    got = _outcomes(tmp_path, None)
    assert got["test_runs"][0] == "passed"
    for name in ("test_skips_in_the_body", "test_skipif_marker", "test_skips_in_a_fixture",
                 "test_needs_a_gpu_by_reason"):
        assert got[name][0] == "skipped", (name, got[name])
    assert got["test_marked_cuda"][0] == ("passed" if GPU else "skipped")
    assert got["test_expected_failure"][0] == "skipped"  # junit writes an xfail as skipped: it is not our rule's


@pytest.mark.heavy
def test_under_ci_a_skip_fails_with_its_reason_unless_it_needs_a_gpu(tmp_path):
    got = _outcomes(tmp_path, "1")
    assert got["test_runs"][0] == "passed"
    for name, reason in [("test_skips_in_the_body", "pip package for module 'x' is not installed"),
                         ("test_skipif_marker", "no C compiler here"),
                         ("test_skips_in_a_fixture", "a fixture's requirement is missing")]:
        outcome, message = got[name]
        assert outcome in ("failure", "error"), (name, got[name])
        assert reason in message and "skipped under CI" in message, (name, message)
    assert got["test_needs_a_gpu_by_reason"][0] == "skipped"
    assert got["test_marked_cuda"][0] == ("passed" if GPU else "skipped")
    assert got["test_expected_failure"][0] == "skipped"  # an xfail is not a skip


@pytest.mark.heavy
def test_ci_0_is_not_ci(tmp_path):
    got = _outcomes(tmp_path, "0")
    assert got["test_skipif_marker"][0] == "skipped"


def test_ci_installs_what_the_skip_prone_tests_need():
    """scripts/test.sh (CI's command) installs the Debian packages behind tests that would otherwise skip: the C
    compiler and headers for kernels/csrc (tests/kernels/test_cpu_attention.py, test_cpu_quantize.py)."""
    import re
    import shlex

    text = (ROOT / "scripts/test.sh").read_text()
    m = re.search(r"apt-get install ((?:[^\n]|\\\n)*)\)", text)
    assert m, "scripts/test.sh installs no Debian packages"
    words = {w for w in shlex.split(m.group(1).replace("\\\n", " ")) if not w.startswith("-")}
    assert {"gcc", "libc6-dev", "prometheus", "docker-compose", "openssl"} <= words, words
    ci = (ROOT / ".ci/run").read_text()
    assert "scripts/test.sh" in ci and "CI=1" in ci  # .ci/run runs the suite under the rule above
