"""Batch-invariant paged attention on the CPU: a small C kernel (``kernels/csrc/paged_attention_cpu.c``).

Same layout and arguments as ``kernels.paged_attention`` (the pool read in place through block tables), but
each query's output is computed by the same instructions in the same order whatever else the pass holds:
its visible keys are cut into chunks of ``CHUNK`` keys at fixed absolute positions, each chunk's partial
softmax is reduced key by key in position order, and the chunks are merged in order (the C file says how).
So a position's attention output is bitwise the same in a one-token decode, a verify window, a prefill chunk
or a batch of 8, and does not depend on the thread count. The chunks also spread one long sequence over
every core (torch's CPU flash attention splits the work by head only).

The kernel is compiled on first use for this CPU and loaded with ctypes (``kernels.cpu_build``: about a
second, cached in ``$SPECDEC_CACHE/kernels``). ``available()`` says whether that worked and why not.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from kernels.cpu_build import KernelUnavailable, build
from kernels.paged_attention import TreePaths

logger = logging.getLogger(__name__)

CHUNK = 512  # keys per chunk: a query's keys are reduced in chunks at multiples of this position
_I32, _I64, _F32, _P = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


@functools.cache
def _library() -> ctypes.CDLL:
    lib = build("paged_attention_cpu", ["-fopenmp"], "CPU attention kernel")
    fn = lib.paged_attention
    fn.restype = _I32
    fn.argtypes = [_P, _P, _P, _I32, _I64, _P, _I32, _P, _P, _P, _P, _I32, _I32, _I32, _I32, _I32, _I32, _I32,
                   _I32, _F32, _P, _I32, _P, _I32, _P, _P, _P]
    return lib


def available() -> tuple[bool, str]:
    """(True, "") when the kernel is built and loaded here, else (False, why not)."""
    try:
        _library()
    except (KernelUnavailable, OSError) as exc:
        return False, str(exc)
    return True, ""


class CpuAttentionPlan:
    """The per-pass arguments of the kernel (each token's sequence and position, the scratch for the chunks'
    partial results), computed once for every layer of a pass."""

    def __init__(self, block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 windows=(None,), tree: TreePaths | None = None):
        self.tables = block_tables.to(torch.int32).contiguous()
        starts = query_start_loc.to(torch.int64)
        counts = starts[1:] - starts[:-1]
        self.tokens, self.seqs = int(starts[-1]), len(counts)
        seq_of = torch.repeat_interleave(torch.arange(self.seqs), counts)
        pos = (context_lens.to(torch.int64) - counts)[seq_of] + torch.arange(self.tokens) - starts[:-1][seq_of]
        self.tree = None
        if tree is not None:  # token trees: each query's own position, and its path (kernels.paged_attention)
            pos = tree.positions.to(torch.int64)
            self.tree = [x.to(torch.int32).contiguous() for x in (tree.starts, tree.offsets, tree.slots)]
        self.seq_of, self.pos = seq_of.to(torch.int32), pos.to(torch.int32)
        self.tok0, self.ntok = starts[:-1].to(torch.int32).contiguous(), counts.to(torch.int32).contiguous()
        self.max_chunks = {}
        for window in windows:
            lo = (pos + 1 - window).clamp_min(0) if window else torch.zeros_like(pos)
            self.max_chunks[window] = int((pos // CHUNK - lo // CHUNK).max()) + 1 if self.tokens else 1
        self._partials: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_size: int, scale: float,
                 window: int | None = None, threads: int | None = None) -> torch.Tensor:
        tokens, heads, dim = q.shape
        kv_heads = k_pool.shape[0]
        if k_pool.dtype not in (torch.float32, torch.bfloat16) or v_pool.dtype != k_pool.dtype:
            raise ValueError(f"the CPU kernel reads float32 or bfloat16 pools, got {k_pool.dtype}/{v_pool.dtype}")
        if k_pool.shape != v_pool.shape or k_pool.stride() != v_pool.stride() or k_pool.stride()[1:] != (dim, 1):
            raise ValueError("k_pool and v_pool must be [kv_heads, slots, dim] with contiguous slots, alike")
        if heads % kv_heads:
            raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
        if tokens != self.tokens:
            raise ValueError(f"q has {tokens} tokens, the plan {self.tokens}")
        out = torch.empty((tokens, heads, dim), dtype=torch.float32)
        if tokens == 0:
            return out.to(q.dtype)
        max_chunks = self.max_chunks[window]
        need = tokens * heads * max_chunks * (dim + 2)
        if self._partials is None or self._partials.numel() < need:
            self._partials = torch.empty(need, dtype=torch.float32)
        qf = q.to(torch.float32).contiguous()
        rc = _library().paged_attention(
            qf.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), int(k_pool.dtype == torch.bfloat16),
            k_pool.stride(0), self.tables.data_ptr(), self.tables.shape[1], self.seq_of.data_ptr(),
            self.pos.data_ptr(), self.tok0.data_ptr(), self.ntok.data_ptr(), tokens, self.seqs, heads, kv_heads, dim,
            block_size, int(window or 0), CHUNK, float(scale), self._partials.data_ptr(), max_chunks, out.data_ptr(),
            threads or torch.get_num_threads(), *([x.data_ptr() for x in self.tree] if self.tree else [None] * 3))
        if rc != 0:
            raise MemoryError("the CPU attention kernel ran out of memory")
        return out if q.dtype == torch.float32 else out.to(q.dtype)


def paged_attention_cpu(
    q: torch.Tensor,                # [tokens, heads, dim]
    k_pool: torch.Tensor,           # [kv_heads, num_blocks * block_size, dim] float32 or bfloat16
    v_pool: torch.Tensor,           # the same
    block_tables: torch.Tensor,     # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,     # [num_seqs] int32, keys per sequence, new tokens included
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    block_size: int,
    scale: float,
    window: int | None = None,
    threads: int | None = None,
    tree: TreePaths | None = None,
) -> torch.Tensor:                  # [tokens, heads, dim], q's dtype
    """``kernels.paged_attention.paged_attention_reference`` by the C kernel (see the module), on CPU tensors.
    (A pass of many layers builds one :class:`CpuAttentionPlan` and calls it per layer.)"""
    plan = CpuAttentionPlan(block_tables, context_lens, query_start_loc, (window,), tree)
    return plan(q, k_pool, v_pool, block_size, scale, window, threads)
