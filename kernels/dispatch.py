"""Which implementation runs: ``SPECDEC_KERNELS=auto|triton|torch`` (or ``kernels=`` / ``--kernels``).

* ``auto`` (default): the Triton kernels on CUDA, the torch reference elsewhere;
* ``triton``: the Triton kernels everywhere; on a CPU they run in Triton's interpreter
  (``TRITON_INTERPRET=1``, set here before triton is imported, with a warning: it is for testing);
* ``torch``: the torch reference everywhere.

Both make the same decisions from the same random numbers (``specdec.rejection`` is the specification),
so the choice changes speed, never output. This module imports triton only when Triton is chosen, and nothing
above the kernels: the callers pick their functions by the backend it resolves (``specdec.rejection.accept``,
``specdec.tli.id_maps.tli_fns``).
"""

from __future__ import annotations

import logging
import os
import sys

MODES = ("auto", "triton", "torch")
ENV = "SPECDEC_KERNELS"
logger = logging.getLogger(__name__)


def kernels_mode(mode: str | None = None) -> str:
    """``mode``, else ``$SPECDEC_KERNELS``, else ``auto``; checked."""
    chosen = (mode or os.environ.get(ENV) or "auto").strip().lower()
    if chosen not in MODES:
        source = "" if mode else f" (from the environment variable {ENV})"
        raise ValueError(f"kernels must be one of {list(MODES)}, got {chosen!r}{source}")
    return chosen


def resolve(mode: str | None, device) -> str:
    """The backend, ``"triton"`` or ``"torch"``, for ``mode`` on ``device`` (a torch.device or its name)."""
    mode = kernels_mode(mode)
    on_cuda = str(device).startswith("cuda")
    if mode == "torch" or (mode == "auto" and not (on_cuda and triton_available())):
        return "torch"
    if not on_cuda:
        use_interpreter()
    return "triton"


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_interpreter() -> None:
    """Run Triton kernels in the interpreter (CPU tensors). Must happen before the kernels are defined."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    defined = [m for m in ("kernels.rejection", "kernels.tli", "kernels.logits") if m in sys.modules]
    if defined:
        raise RuntimeError(f"SPECDEC_KERNELS=triton on a CPU needs TRITON_INTERPRET=1 before {defined[0]} is imported; "
                           "set it in the environment")
    logger.warning("SPECDEC_KERNELS=triton on a CPU: the Triton kernels run in Triton's interpreter "
                   "(TRITON_INTERPRET=1), which is for testing and slow")
    os.environ["TRITON_INTERPRET"] = "1"
