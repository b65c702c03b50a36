"""Kernel tests run the Triton kernels for real on CUDA, else in Triton's interpreter on the CPU.

The interpreter has to be chosen before any kernel is defined, so it is chosen here, at collection.
"""

from __future__ import annotations

import torch

from kernels.dispatch import use_interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    use_interpreter()
