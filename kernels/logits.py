"""Logits processing in Triton: per-row temperature + softmax over the batch, tiled (two passes: an online
max/sum, then the write), so a 262,144-id row never has to fit in one block.

Its torch reference is ``temperature_softmax_reference`` below, the same steps ``specdec.sampling.process_logits``
takes when top-k and top-p are off. NOT dispatched: the verification path keeps torch's ``process_logits``
(top-k and top-p need a sort or a threshold search, and a softmax that rounds differently from torch's would
make the Triton and torch paths differ). ``benchmarks/bench_kernels.py`` times this kernel against torch on a
GPU; it goes into the path only if it wins there, bit-compatible or with both paths switched together.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _temperature_softmax_kernel(x_ptr, t_ptr, out_ptr, stride, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    inv_t = 1.0 / tl.load(t_ptr + row)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile of -inf only: no -inf - -inf
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
        m = m_new
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * inv_t
        tl.store(out_ptr + row * stride + cols, tl.exp(x - m) / s, mask=cols < vocab)


def temperature_softmax(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab], temperature [rows] (> 0) → float32 probabilities [rows, vocab]."""
    x = logits.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    block = 4096 if x.device.type == "cuda" else 65536
    if x.numel():
        _temperature_softmax_kernel[(x.shape[0],)](x, temperature.to(torch.float32).contiguous(), out, x.stride(0),
                                                   x.shape[1], BLOCK=block)
    return out


def temperature_softmax_reference(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    return (logits.float() / temperature.float()[:, None]).softmax(-1)
