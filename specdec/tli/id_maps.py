"""The two tensor operations of the TLI id mapping (torch references of ``kernels/tli.py``; ``kernels.dispatch``
picks one or the other)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def scatter_ids(src: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor, size: int, fill: float) -> torch.Tensor:
    """src [..., V_src] → [..., size]: ``out[..., dst_ids] = src[..., src_ids]``, every other id ``fill``
    (the torch reference of ``kernels.tli.scatter_ids``)."""
    out = src.new_full((*src.shape[:-1], size), fill)
    out[..., dst_ids] = src[..., src_ids]
    return out


def mask_ids(x: torch.Tensor, keep: torch.Tensor, fill: float) -> torch.Tensor:
    """x [..., V] with every id v where ``keep[v]`` is False (or v >= len(keep)) set to ``fill`` (the torch
    reference of ``kernels.tli.mask_ids``)."""
    v = x.shape[-1]
    if v <= keep.numel():
        keep = keep[:v]
    else:
        keep = torch.cat([keep, torch.zeros(v - keep.numel(), dtype=torch.bool, device=x.device)])
    return x.masked_fill(~keep.bool(), fill)


def tli_fns(backend: str) -> tuple[Callable, Callable]:
    """(scatter_ids, mask_ids) of ``backend`` (``kernels.dispatch.resolve``): the Triton twins (``kernels/tli.py``)
    or these."""
    if backend == "triton":
        from kernels.tli import mask_ids as triton_mask, scatter_ids as triton_scatter

        return triton_scatter, triton_mask
    return scatter_ids, mask_ids
