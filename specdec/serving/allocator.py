"""The C allocator of a serving process: give freed memory back to the system.

glibc's malloc serves a big block from its own heap once the process has freed a big block before (its mmap
threshold grows with each such free, up to 32 MiB), and a heap rarely shrinks. A service frees big blocks
while it starts: the float32 weights a bfloat16 model is converted from, the unpacked weights the lean forward
replaces with oneDNN's packed copies (``specdec.engine.memory.release_unread``). Fixing the threshold (128 KiB,
glibc's own default) makes every big block an mmap of its own, unmapped when freed. Measured in one
process loading the default pair as ``specdec serve`` does (AMD EPYC, torch 2.13): resident after both models
1,096 MiB before, 874 MiB with it; ``specdec serve`` after three requests 1,197 -> 969 MiB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD_BYTES = 128 * 1024


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold (see the module); False where the C library is not glibc (nothing changes)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    logger.debug("malloc: mmap threshold fixed at %d bytes: %s", MMAP_THRESHOLD_BYTES, ok)
    return ok
