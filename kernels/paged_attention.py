"""Paged (block-table) varlen attention over one layer of the KV block pool: the torch reference (the
specification, and the CPU path) and its Triton twin (the CUDA path).

Layout, shared with the CPU engine:
  * ``k_pool``, ``v_pool``: ``[kv_heads, num_blocks * block_size, head_dim]``; slot s of block b is row
    ``b * block_size + s`` of dim 1. Dim 0 may be strided (a view into a bigger pool): strides are taken.
  * ``block_tables``: int32 ``[num_seqs, max_blocks_per_seq]``, logical block i of sequence s is physical block
    ``block_tables[s, i]``; entries past the sequence's last block are never read.
  * ``q``: ``[total_new_tokens, heads, head_dim]``, the new tokens of every sequence concatenated;
    ``query_start_loc``: int32 ``[num_seqs + 1]`` offsets into it; ``context_lens``: int32 ``[num_seqs]``, the
    keys of each sequence INCLUDING its new tokens (whose keys and values are already in the pool).
  * Query j of the n_s new tokens of sequence s sits at position ``context_lens[s] - n_s + j`` and sees the
    keys at positions ``<= pos`` and, with ``window`` (Gemma-3's sliding window: ``window`` keys counting
    itself), only those ``> pos - window``.
  * GQA: head h reads kv head ``h // (heads // kv_heads)``.
The output is ``[total_new_tokens, heads, head_dim]`` in q's dtype; scores, softmax and the weighted sum are
float32 in both paths.

Token trees (``tree``, a :class:`TreePaths`; ``specdec.trees``): a tree's nodes are written to consecutive
positions after the history, one per node, but each node attends as if it were the last token of a chain: the
history, then its ancestors and itself. So each query has its own position (the history's length plus its
depth) and, from the tree's first position on, reads its keys through its own path of pool rows instead of the
block table. A node's output is then bitwise the output of the same tokens verified as a chain, in every
implementation (the same keys, at the same positions, reduced in the same order).

The Triton kernel runs one program per (new token, head): an online softmax (flash-attention style) over the
sequence's key blocks, taken in order through its block table, from the first block the window reaches to the
block holding the query's own position. The keys are reduced in splits of ``split_keys(block_size)`` keys (512)
at fixed absolute positions: each split's softmax starts afresh, and the splits are merged in order. A pass of
few queries (decodes, verify windows: ``PARALLEL_SPLITS_MAX_TOKENS``) runs one program per (token, head, split)
instead, then a merge program per (token, head) that merges the splits in the same order (flash-decoding,
vLLM's paged attention v2): a long history is spread over the GPU's cores, and, because the split points and
the merge are the same arithmetic in both modes, a query's output is bitwise the same either way. That makes
it batch-invariant: a query's output depends on its q, its sequence's keys and values and its position only,
never on the rest of the pass (alone as a decode, in a window of its sequence, beside other sequences: bitwise
equal, tests/kernels/test_batch_invariant.py). Its reductions take the K/V tiles' layout, so q's alignment does
not change them either (an sm_90 compile with and without q 16-byte aligned gives the same layouts). Triton is
imported and the kernel jit-decorated on first use, not at import, so the engine can import this module (for
the reference and ``paged_attention``) before ``kernels.dispatch`` has chosen Triton's interpreter for a CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

tl = None  # triton.language, imported by ``_kernel`` on first use, for the kernel body below

NO_TREE = 2 ** 31 - 1  # TreePaths.starts of a query outside any tree: it never reads a path


def tree_layout(start: int, count: int, parents: list[int] | None) -> tuple[int, int, int, list[int]]:
    """A row of ``count`` new tokens from position ``start`` whose tree (``parents``) ends the row: (its chain
    tokens before the tree's nodes, the tree's first position, the first node this row feeds, each node's depth).
    The nodes before that one were fed by earlier passes (a drafter growing its tree a level per pass)."""
    if not parents:
        return count, start + count, 0, []
    fed = min(count, len(parents))
    chain = count - fed
    depth: list[int] = []
    for parent in parents:
        depth.append(0 if parent < 0 else depth[parent] + 1)
    return chain, start + chain + fed - len(parents), len(parents) - fed, depth


@dataclass
class TreePaths:
    """Where each query of a pass reads its keys when some rows are token trees (see the module): int32 tensors
    on the pass's device. ``positions`` [tokens]: each query's position. ``starts`` [tokens]: the first position
    it reads through its path (``NO_TREE``: none, it reads the block table only). ``offsets`` [tokens]: where its
    path begins in ``slots``; ``slots`` [total]: pool rows, one per position from ``starts`` to the query's own."""

    positions: torch.Tensor
    starts: torch.Tensor
    offsets: torch.Tensor
    slots: torch.Tensor

    @classmethod
    def of(cls, tables: list[list[int]], starts: list[int], counts: list[int], trees: list[list[int] | None],
           block_size: int, device: torch.device | str = "cpu") -> "TreePaths":
        """A pass's paths: row i feeds ``counts[i]`` tokens from position ``starts[i]`` through block table
        ``tables[i]``; with ``trees[i]`` (parents, ``specdec.trees``) the tree's nodes are written in node order from
        the tree's first position, and the row's last ``min(counts[i], len(trees[i]))`` tokens are its last nodes
        (earlier nodes: fed by earlier passes), each attending as its path (``tree_layout``)."""
        positions: list[int] = []
        first: list[int] = []
        offsets: list[int] = []
        slots: list[int] = []
        for table, start, n, parents in zip(tables, starts, counts, trees):
            chain, root, new, depth = tree_layout(start, n, parents)
            positions += range(start, start + chain)
            first += [NO_TREE] * chain
            offsets += [0] * chain
            paths: list[list[int]] = []
            for i, parent in enumerate(parents or ()):
                p = root + i
                paths.append((paths[parent] if parent >= 0 else []) + [table[p // block_size] * block_size + p % block_size])
                if i < new:
                    continue
                positions.append(root + depth[i])
                first.append(root)
                offsets.append(len(slots))
                slots += paths[i]
        def as_tensor(x):
            return torch.tensor(x or [0], dtype=torch.int32, device=device)
        return cls(as_tensor(positions), as_tensor(first), as_tensor(offsets), as_tensor(slots))


def _check(q, k_pool, v_pool, block_tables, context_lens, query_start_loc, block_size, window) -> None:
    tokens, heads, dim = q.shape
    kv_heads, slots, kdim = k_pool.shape
    if v_pool.shape != k_pool.shape or kdim != dim:
        raise ValueError(f"k_pool {tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)} must be "
                         f"[kv_heads, slots, {dim}]")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if window is not None and window < 1:
        raise ValueError(f"window must be at least 1 (the query's own key), got {window}")
    if block_size <= 0 or slots % block_size:
        raise ValueError(f"the pool's {slots} slots are not whole blocks of {block_size}")
    num_seqs = block_tables.shape[0]
    if context_lens.shape != (num_seqs,) or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"{num_seqs} block tables need context_lens [{num_seqs}] and query_start_loc "
                         f"[{num_seqs + 1}], got {tuple(context_lens.shape)} and {tuple(query_start_loc.shape)}")


def paged_attention_reference(
    q: torch.Tensor,                # [tokens, heads, dim]
    k_pool: torch.Tensor,           # [kv_heads, num_blocks * block_size, dim]
    v_pool: torch.Tensor,           # [kv_heads, num_blocks * block_size, dim]
    block_tables: torch.Tensor,     # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,     # [num_seqs] int32, keys per sequence, new tokens included
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    block_size: int,
    scale: float,
    window: int | None = None,
    tree: TreePaths | None = None,
) -> torch.Tensor:                  # [tokens, heads, dim], q's dtype
    """The specification: gather each sequence's keys through its block table, then masked softmax in fp32.
    With ``tree``, each query of a tree reads its own keys (its path), one query at a time."""
    _check(q, k_pool, v_pool, block_tables, context_lens, query_start_loc, block_size, window)
    if tree is not None:
        return _tree_reference(q, k_pool, v_pool, block_tables, query_start_loc, block_size, scale, window, tree)
    group = q.shape[1] // k_pool.shape[0]
    out = torch.empty_like(q)
    starts, lens, tables = query_start_loc.tolist(), context_lens.tolist(), block_tables.long()
    for s, ctx in enumerate(lens):
        start, end = starts[s], starts[s + 1]
        n = end - start
        if n == 0:
            continue
        if not n <= ctx <= tables.shape[1] * block_size:
            raise ValueError(f"sequence {s}: {n} new tokens, {ctx} keys, {tables.shape[1]} blocks of {block_size}")
        blocks = tables[s, : -(-ctx // block_size)]                                       # [blocks]
        rows = (blocks[:, None] * block_size + torch.arange(block_size, device=q.device)).flatten()[:ctx]
        k = k_pool[:, rows].float().repeat_interleave(group, dim=0)                       # [heads, ctx, dim]
        v = v_pool[:, rows].float().repeat_interleave(group, dim=0)                       # [heads, ctx, dim]
        qs = q[start:end].float().transpose(0, 1)                                         # [heads, n, dim]
        scores = qs @ k.transpose(1, 2) * scale                                           # [heads, n, ctx]
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]                      # [n, 1]
        k_pos = torch.arange(ctx, device=q.device)[None, :]                               # [1, ctx]
        allowed = k_pos <= q_pos                                                          # [n, ctx]
        if window is not None:
            allowed &= k_pos > q_pos - window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)                   # [heads, n, ctx]
        out[start:end] = (probs @ v).transpose(0, 1).to(q.dtype)                          # [n, heads, dim]
    return out


def _tree_reference(q, k_pool, v_pool, block_tables, query_start_loc, block_size, scale, window, tree):
    """The reference with token trees: each query's keys are positions [lo, pos], read through the block table
    before ``starts[t]`` and through its path from there."""
    group = q.shape[1] // k_pool.shape[0]
    out = torch.empty_like(q)
    qsl, tables = query_start_loc.tolist(), block_tables.long()
    positions, starts, offsets = tree.positions.tolist(), tree.starts.tolist(), tree.offsets.tolist()
    for s in range(len(qsl) - 1):
        for t in range(qsl[s], qsl[s + 1]):
            pos = positions[t]
            lo = max(0, pos + 1 - window) if window is not None else 0
            keys = torch.arange(lo, pos + 1, device=q.device)
            rows = tables[s, keys // block_size] * block_size + keys % block_size
            through = keys >= starts[t]
            if bool(through.any()):
                rows[through] = tree.slots[offsets[t] + keys[through] - starts[t]].long()
            k = k_pool[:, rows].float().repeat_interleave(group, dim=0)                   # [heads, keys, dim]
            v = v_pool[:, rows].float().repeat_interleave(group, dim=0)
            scores = (q[t].float()[:, None, :] @ k.transpose(1, 2))[:, 0] * scale           # [heads, keys]
            out[t] = (scores.softmax(-1)[:, None, :] @ v)[:, 0].to(q.dtype)               # [heads, dim]
    return out


# keys per split (rounded to whole blocks): a query's keys are reduced in splits at multiples of this position
SPLIT_KEYS = 512
# a pass of at most this many new tokens runs its splits as programs of their own (then a merge program)
PARALLEL_SPLITS_MAX_TOKENS = 64


def split_keys(block_size: int) -> int:
    return max(1, SPLIT_KEYS // block_size) * block_size


def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, ctx_ptr, qsl_ptr, seq_of_ptr, part_ptr,
    tpos_ptr, tstart_ptr, toff_ptr, tslots_ptr,
    q_t, q_h, q_d, k_h, k_s, k_d, v_h, v_s, v_d, o_t, o_h, table_stride,
    scale, window, group, head_dim, block_size, max_splits,
    HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_BLOCKS: tl.constexpr,
    PARALLEL: tl.constexpr, HAS_TREE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # the new token
    h = tl.program_id(1).to(tl.int64)  # its head
    seq = tl.load(seq_of_ptr + t)
    q_start = tl.load(qsl_ptr + seq)
    n_new = tl.load(qsl_ptr + seq + 1) - q_start
    pos = tl.load(ctx_ptr + seq) - n_new + (t - q_start)  # the query's position in its sequence
    t_start = pos * 0  # token trees: from this position on, its keys are read through its path
    t_off = pos * 0
    if HAS_TREE:
        pos = tl.load(tpos_ptr + t).to(tl.int64)
        t_start = tl.load(tstart_ptr + t).to(tl.int64)
        t_off = tl.load(toff_ptr + t).to(tl.int64)
    lo = pos * 0  # the first key it sees
    if HAS_WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
    kv_h = h // group
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + t * q_t + h * q_h + d * q_d, mask=d_ok, other=0.0).to(tl.float32) * scale  # [BLOCK_D]
    slot = tl.arange(0, BLOCK_N)
    first_split = lo // block_size // SPLIT_BLOCKS
    last_split = pos // block_size // SPLIT_BLOCKS
    if PARALLEL:  # this program: one split (relative to the query's first); the merge program combines them
        first_split = first_split + tl.program_id(2)
        last_split = tl.minimum(first_split, last_split)  # past the query's last split: nothing to do
    big_m = tl.full((), float("-inf"), tl.float32)  # the merged splits: max, sum of exp, weighted values
    big_l = tl.full((), 0.0, tl.float32)
    big_acc = tl.zeros((BLOCK_D,), tl.float32)
    for sp in range(first_split, last_split + 1):
        m = tl.full((), float("-inf"), tl.float32)  # running max of the split's scores
        l = tl.full((), 0.0, tl.float32)            # running sum of exp(score - m)
        acc = tl.zeros((BLOCK_D,), tl.float32)      # running sum of exp(score - m) * v
        b0 = tl.maximum(sp * SPLIT_BLOCKS, lo // block_size)
        b1 = tl.minimum((sp + 1) * SPLIT_BLOCKS, pos // block_size + 1)
        for b in range(b0, b1):  # logical blocks, in order
            physical = tl.load(tables_ptr + seq * table_stride + b).to(tl.int64)
            k_pos = b * block_size + slot                                        # [BLOCK_N]
            ok = (slot < block_size) & (k_pos <= pos) & (k_pos >= lo)            # [BLOCK_N]
            row = physical * block_size + slot                                   # [BLOCK_N] rows of the pool
            if HAS_TREE:  # a tree's node: its ancestors' rows (and its own) from the tree's first position
                through = ok & (k_pos >= t_start)
                path_row = tl.load(tslots_ptr + t_off + (k_pos - t_start), mask=through, other=0).to(tl.int64)
                row = tl.where(through, path_row, row)
            mask = ok[:, None] & d_ok[None, :]                                   # [BLOCK_N, BLOCK_D]
            k = tl.load(k_ptr + kv_h * k_h + row[:, None] * k_s + d[None, :] * k_d, mask=mask, other=0.0)
            s = tl.sum(k.to(tl.float32) * q[None, :], axis=1)                    # [BLOCK_N]
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf while nothing is seen yet
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe)                                               # [BLOCK_N], 0 where masked
            v = tl.load(v_ptr + kv_h * v_h + row[:, None] * v_s + d[None, :] * v_d, mask=mask, other=0.0)
            acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)    # [BLOCK_D]
            l = l * alpha + tl.sum(p, axis=0)
            m = m_new
        if PARALLEL:  # the split's (m, l, acc) for the merge program
            base = part_ptr + ((t * tl.num_programs(1) + h) * max_splits + tl.program_id(2)) * (BLOCK_D + 2)
            tl.store(base, m)
            tl.store(base + 1, l)
            tl.store(base + 2 + d, acc)
        else:  # merged in order (every split holds a key the query sees: m is finite), as _merge_kernel does
            big_m, big_l, big_acc = _merge_split(big_m, big_l, big_acc, m, l, acc)
    if not PARALLEL:
        tl.store(out_ptr + t * o_t + h * o_h + d, (big_acc / big_l).to(out_ptr.dtype.element_ty), mask=d_ok)


def _merge_split_fn(big_m, big_l, big_acc, m, l, acc):
    """The merged splits (max, sum of exp, weighted values) with one more split's: one function for both
    kernels, so the one-program and the split-per-program passes do the same arithmetic."""
    m_all = tl.maximum(big_m, m)
    a = tl.exp(big_m - m_all)
    w = tl.exp(m - m_all)
    return m_all, big_l * a + l * w, big_acc * a + acc * w


_merge_split = None  # the jit function of _merge_split_fn, made with the kernels (the kernels call it by this name)


def _merge_kernel(
    out_ptr, ctx_ptr, qsl_ptr, seq_of_ptr, part_ptr, tpos_ptr, o_t, o_h, window, head_dim, block_size, max_splits,
    HAS_WINDOW: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, HAS_TREE: tl.constexpr,
):
    """Per (token, head): the splits' partial results merged in order, the same arithmetic as the one-program
    kernel's merge (so the output is the same bits)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    seq = tl.load(seq_of_ptr + t)
    q_start = tl.load(qsl_ptr + seq)
    n_new = tl.load(qsl_ptr + seq + 1) - q_start
    pos = tl.load(ctx_ptr + seq) - n_new + (t - q_start)
    if HAS_TREE:
        pos = tl.load(tpos_ptr + t).to(tl.int64)
    lo = pos * 0
    if HAS_WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
    d = tl.arange(0, BLOCK_D)
    splits = pos // block_size // SPLIT_BLOCKS - lo // block_size // SPLIT_BLOCKS + 1
    big_m = tl.full((), float("-inf"), tl.float32)
    big_l = tl.full((), 0.0, tl.float32)
    big_acc = tl.zeros((BLOCK_D,), tl.float32)
    for i in range(0, splits):
        base = part_ptr + ((t * tl.num_programs(1) + h) * max_splits + i) * (BLOCK_D + 2)
        m = tl.load(base)
        l = tl.load(base + 1)
        acc = tl.load(base + 2 + d)
        big_m, big_l, big_acc = _merge_split(big_m, big_l, big_acc, m, l, acc)
    tl.store(out_ptr + t * o_t + h * o_h + d, (big_acc / big_l).to(out_ptr.dtype.element_ty), mask=d < head_dim)


@functools.cache
def _kernel():
    """The jit kernel, made on first use: ``import triton`` and ``triton.jit`` fix compiled or interpreted
    (``TRITON_INTERPRET``) when they run, so neither may happen at this module's import."""
    global tl, _merge_split
    import triton
    import triton.language

    tl = triton.language
    _merge_split = triton.jit(_merge_split_fn)
    return triton.jit(_paged_attention_kernel), triton.jit(_merge_kernel)


def paged_attention_triton(
    q: torch.Tensor,                # [tokens, heads, dim]
    k_pool: torch.Tensor,           # [kv_heads, num_blocks * block_size, dim]
    v_pool: torch.Tensor,           # [kv_heads, num_blocks * block_size, dim]
    block_tables: torch.Tensor,     # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,     # [num_seqs] int32, keys per sequence, new tokens included
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    block_size: int,
    scale: float,
    window: int | None = None,
    parallel: bool | None = None,
    tree: TreePaths | None = None,
) -> torch.Tensor:                  # [tokens, heads, dim], q's dtype
    """Triton twin of ``paged_attention_reference``, without host syncs (so the sequences' lengths are not
    checked: each needs ``new tokens <= context_lens[s] <= its blocks * block_size``). On a CPU it runs in
    Triton's interpreter. ``parallel``: one program per split, then the merge (None: for a pass of few tokens
    over more than one split; the output is the same bits either way)."""
    _check(q, k_pool, v_pool, block_tables, context_lens, query_start_loc, block_size, window)
    if q.device.type != "cuda":
        from kernels.dispatch import use_interpreter

        use_interpreter()
    import triton

    tokens, heads, dim = q.shape
    out = torch.empty((tokens, heads, dim), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    tables = block_tables.to(torch.int32)
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    qsl = query_start_loc.to(torch.int32).contiguous()
    ctx = context_lens.to(torch.int32).contiguous()
    token = torch.arange(tokens, dtype=torch.int32, device=q.device)
    seq_of = torch.searchsorted(qsl[1:], token, right=True, out_int32=True)  # [tokens] each token's sequence
    split_blocks = split_keys(block_size) // block_size
    max_splits = -(-tables.shape[1] // split_blocks)  # from the tables' width: no host sync
    if parallel is None:
        parallel = tokens <= PARALLEL_SPLITS_MAX_TOKENS and max_splits > 1
    block_d = triton.next_power_of_2(dim)
    part = torch.empty((tokens, heads, max_splits, block_d + 2) if parallel else (1,), dtype=torch.float32,
                       device=q.device)
    attend, merge = _kernel()
    if tree is not None:
        paths = [x.to(device=q.device, dtype=torch.int32).contiguous()
                 for x in (tree.positions, tree.starts, tree.offsets, tree.slots)]
    else:
        paths = [token] * 4  # never read
    attend[(tokens, heads, max_splits if parallel else 1)](
        q, k_pool, v_pool, out, tables, ctx, qsl, seq_of, part, *paths,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), out.stride(0), out.stride(1), tables.stride(0),
        float(scale), int(window or 0), heads // k_pool.shape[0], dim, block_size, max_splits,
        HAS_WINDOW=window is not None, BLOCK_N=triton.next_power_of_2(block_size), BLOCK_D=block_d,
        SPLIT_BLOCKS=split_blocks, PARALLEL=parallel, HAS_TREE=tree is not None,
    )
    if parallel:
        merge[(tokens, heads)](out, ctx, qsl, seq_of, part, paths[0], out.stride(0), out.stride(1), int(window or 0),
                               dim, block_size, max_splits, HAS_WINDOW=window is not None, BLOCK_D=block_d,
                               SPLIT_BLOCKS=split_blocks, HAS_TREE=tree is not None)
    return out


def paged_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int, scale: float,
    window: int | None = None, backend: str | None = None, tree: TreePaths | None = None,
) -> torch.Tensor:  # [tokens, heads, dim]
    """Paged attention with ``backend`` ``"auto"`` (None: ``$SPECDEC_KERNELS``, else auto), ``"triton"`` or
    ``"torch"``, resolved by ``kernels.dispatch.resolve``: Triton on CUDA, the torch reference on a CPU unless
    Triton is forced (then interpreted, for tests)."""
    from kernels.dispatch import resolve

    fn = paged_attention_triton if resolve(backend, q.device) == "triton" else paged_attention_reference
    args = (q, k_pool, v_pool, block_tables, context_lens, query_start_loc, block_size, scale, window)
    return fn(*args) if tree is None else fn(*args, tree=tree)
