"""Token-Level Intersection mapping in Triton, beside its torch reference (``specdec.tli.vocab_mapping``):

* ``scatter_ids``: ``out[r, dst_ids] = src[r, src_ids]``, every other id ``fill`` — a draft's q or logits over the
  intersection, moved into target ids (fill 0 for q, -inf for logits);
* ``mask_ids``: ``out[r, v] = x[r, v] if keep[v] else fill`` — the draft's logits with non-intersection ids at -inf.

Pure data movement, so the results are bit-identical to the reference. Import through ``kernels.dispatch``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _scatter_kernel(src_ptr, src_stride, src_ids_ptr, dst_ids_ptr, out_ptr, out_stride, n_pairs,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_pairs
    s = tl.load(src_ids_ptr + offs, mask=m, other=0)
    d = tl.load(dst_ids_ptr + offs, mask=m, other=0)
    v = tl.load(src_ptr + row * src_stride + s, mask=m)
    tl.store(out_ptr + row * out_stride + d, v, mask=m)


@triton.jit
def _mask_kernel(x_ptr, keep_ptr, out_ptr, stride, vocab, n_keep, fill, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < vocab
    keep = tl.load(keep_ptr + cols, mask=m & (cols < n_keep), other=0) != 0  # ids past the mask: not kept
    x = tl.load(x_ptr + row * stride + cols, mask=m)
    tl.store(out_ptr + row * stride + cols, tl.where(keep, x, fill), mask=m)


def _block(device: torch.device) -> int:
    return 1024 if device.type == "cuda" else 65536  # the interpreter: few, big tiles


def scatter_ids(src: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor, size: int, fill: float) -> torch.Tensor:
    """src [..., V_src] → [..., size]: ``out[..., dst_ids] = src[..., src_ids]``, elsewhere ``fill``."""
    lead = src.shape[:-1]
    flat = src.reshape(-1, src.shape[-1]).contiguous()
    out = flat.new_full((flat.shape[0], size), fill)
    n = src_ids.numel()
    if n and flat.shape[0]:
        block = _block(src.device)
        _scatter_kernel[(flat.shape[0], triton.cdiv(n, block))](flat, flat.stride(0), src_ids.contiguous(),
                                                                 dst_ids.contiguous(), out, out.stride(0), n, BLOCK=block)
    return out.reshape(*lead, size)


def mask_ids(x: torch.Tensor, keep: torch.Tensor, fill: float) -> torch.Tensor:
    """x [..., V] with ids v where ``keep[v]`` is False (or v >= len(keep)) set to ``fill``."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(flat)
    vocab = flat.shape[-1]
    if flat.numel():
        block = _block(x.device)
        _mask_kernel[(flat.shape[0], triton.cdiv(vocab, block))](flat, (keep if keep.dtype == torch.int8 else keep.to(torch.int8)).contiguous(), out,
                                                                 flat.stride(0), vocab, keep.numel(), fill, BLOCK=block)
    return out.reshape(x.shape)
