"""Build a C kernel of ``kernels/csrc`` for this CPU on first use and load it with ctypes.

The file is compiled with the machine's C compiler (``$CC``, else ``cc``/``gcc``/``clang``) for this CPU
(``-O3 -march=native``) into ``$SPECDEC_CACHE/kernels``, keyed by the source, the compiler, the flags and the
CPU's flags, then loaded with ctypes: no Python headers, no torch headers, about a second. Used by
``kernels.cpu_attention`` and ``kernels.cpu_quantize``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")


class KernelUnavailable(RuntimeError):
    """A C kernel could not be built or loaded here (no compiler, an unsupported CPU or OS)."""


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def cache_root() -> Path:
    """Where specdec caches what it builds or measures (``$SPECDEC_CACHE``, else ~/.cache/specdec): defined here,
    at the bottom (kernels import nothing above them); ``specdec.engine.cache_files`` re-exports it."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def _cache_dir() -> Path:
    return cache_root() / "kernels"


def build(name: str, flags: list[str], what: str) -> ctypes.CDLL:
    """``csrc/<name>.c`` built with ``flags`` (cached) and loaded; KernelUnavailable saying why not."""
    source_path = CSRC / f"{name}.c"
    cc = compiler()
    if cc is None:
        raise KernelUnavailable(f"no C compiler found (set $CC, or install gcc) to build the {what}")
    source = source_path.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    flags = ["-O3", "-march=native", "-shared", "-fPIC", *flags]
    key = hashlib.sha256(b"\0".join([source, " ".join([cc, *version, *flags]).encode(), cpu_flags().encode()]))
    target = _cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        for directory in (target.parent, Path(tempfile.gettempdir()) / "specdec-kernels"):
            try:
                directory.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
                os.close(fd)
                break
            except OSError:
                continue
        else:
            raise KernelUnavailable(f"no writable directory for the compiled {what} ({target.parent})")
        run = subprocess.run([cc, *flags, "-o", tmp, str(source_path), "-lm"], capture_output=True, text=True)
        if run.returncode != 0:
            os.unlink(tmp)
            raise KernelUnavailable(f"{cc} could not build {source_path.name}: {run.stderr.strip()[-500:]}")
        target = Path(tmp).with_name(target.name)
        os.replace(tmp, target)  # atomic: a concurrent build by another process is the same file
        logger.info("built the %s: %s", what, target)
    return ctypes.CDLL(str(target))
