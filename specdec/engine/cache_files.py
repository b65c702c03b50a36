"""Small JSON files and locks under the cache that several processes share (``$SPECDEC_CACHE``): the dtype
choices (:mod:`specdec.engine.dtype_choice`), the GGUF digest index and the converted folders
(:mod:`specdec.engine.models`)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

from kernels.cpu_build import cache_root  # noqa: F401 - the one definition of $SPECDEC_CACHE's default


def read_json_dict(path: Path) -> dict:
    """The JSON object in ``path``; {} where the file is missing, unreadable, malformed or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename: a reader sees the old file or the new
    one, never half of one. Raises OSError (a read-only cache) and leaves no temporary file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def file_lock(path: Path):
    """Processes sharing the cache take turns on ``path`` (an exclusive ``flock`` on ``path.lock``), so the later
    one finds the earlier one's result instead of redoing it. Where locking is impossible (no fcntl, a read-only
    cache) it runs unlocked: every writer here is atomic, so that costs duplicate work, never a broken file."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_name(path.name + ".lock"), "a")
    except (ImportError, OSError):
        handle = None
    try:
        if handle is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        if handle is not None:
            handle.close()
