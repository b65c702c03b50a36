"""What a model holds in memory: the bytes of its weights counted once, and the process's resident set.

A weight may be reachable several ways (a transformers module, the lean decoder's fused matrix it is a view of,
a tied LM head); :func:`weight_bytes` counts each storage once. oneDNN's packed copies (CPU) are opaque tensors
with no shared storage: each counts its own size. The services log both numbers at start-up and export the
weights as the ``specdec_model_weight_bytes`` gauge.
"""

from __future__ import annotations

import dataclasses
import os
import resource
from collections.abc import Iterator
from typing import Any

import torch


def held_tensors(*roots: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``roots``: a module's parameters and buffers, the attributes of specdec's
    own objects (lean decoders, their layers and products, quantization plans), lists, tuples and dicts."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, torch.nn.Module):
            stack += [*obj.parameters(), *obj.buffers()]
        elif isinstance(obj, (list, tuple, set)):
            stack += list(obj)
        elif isinstance(obj, dict):
            stack += list(obj.values())
        elif type(obj).__module__.startswith("specdec.") and (hasattr(obj, "__dict__") or dataclasses.is_dataclass(obj)):
            stack += list(vars(obj).values())


def weight_bytes(*roots: Any) -> int:
    """Bytes of the tensors reachable from ``roots``, each storage counted once (views and ties share one)."""
    total, storages = 0, set()
    for t in held_tensors(*roots):
        if t.is_mkldnn or t.layout != torch.strided:  # opaque (oneDNN packed): its own memory
            total += t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in storages:
            storages.add(key)
            total += storage.nbytes()
    return total


def resident_bytes() -> int:
    """The process's resident set now (Linux: /proc/self/statm), else its peak (getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_unread(model: torch.nn.Module, net: Any) -> int:
    """Let go of the weights of ``model``'s linear layers that ``net`` (the lean forward built on it) never
    reads: those it holds only as oneDNN-packed or int8 copies. Returns the bytes let go.

    A released weight keeps its shape and dtype (a zero-stride view of one element: readers of shapes, such as
    the vocabulary size, still work) and its module refuses to run (a pre-hook raises), so ``model``'s own
    forward fails loudly rather than computing with missing weights. Only for a model that one lean forward
    owns (a service's; the runner's ``release_unread_weights``), never one shared with other runners."""
    read = {(str(t.device), t.untyped_storage().data_ptr()) for t in held_tensors(net)
            if not t.is_mkldnn and t.layout == torch.strided}
    freed = 0
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not isinstance(module, torch.nn.Linear) or weight is None or 0 in weight.stride():
                continue
            if (str(weight.device), weight.untyped_storage().data_ptr()) in read:
                continue
            freed += weight.numel() * weight.element_size()
            weight.data = weight.data.new_zeros(()).expand(weight.shape)
            module.register_forward_pre_hook(_released)
    return freed


def _released(module: torch.nn.Module, args: Any) -> None:
    raise RuntimeError(f"{type(module).__name__}: its weights were released (the lean forward holds them packed); "
                       "this model's transformers forward cannot run")
